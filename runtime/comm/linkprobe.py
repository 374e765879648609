"""Measure the link between neighbouring pipeline ranks with a short ping-pong.

The planner prices every cut as ``latency + bytes / bandwidth``. A guessed link misprices cuts
(gloo over loopback, NVLink and Ethernet differ by orders of magnitude), so ``compile`` measures
it: each neighbouring pair (r, r + 1) in turn bounces a small and a large message a few times,
one-way time is half the fastest round trip (interference only ever adds time), and latency
and bandwidth come from the two sizes. Where the large message is not measurably slower than the
small one (a loaded host, a link too fast for the clock), at least half the large message's time
is charged to its bytes: a bandwidth that errs low, never absurdly high. Pairs
run one after another (on a shared host, concurrent pairs would measure each other). Every rank
gets the same answer: the slowest pair's, since one link prices every cut of the plan.

Sends and receives are blocking and paired in a fixed order (the lower rank sends first), which
is safe under NCCL's rendezvous rules; on CUDA the device is synchronised before reading the
clock, since NCCL calls return before the transfer ends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipecut.cluster import Link

__all__ = ["measure_link"]

SMALL_BYTES = 4 << 10
LARGE_BYTES = 4 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_way_ms(
    buf: torch.Tensor, peer: int, first: bool, group: dist.ProcessGroup | None, repeats: int
) -> float:
    samples = []
    for i in range(repeats + 1):  # the first round trip warms the connection up
        _sync(buf.device)
        start = time.perf_counter()
        if first:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
        _sync(buf.device)
        if i:
            samples.append((time.perf_counter() - start) * 1e3 / 2)
    return min(samples)


def _per_byte_ms(small_ms: float, large_ms: float) -> float:
    """Milliseconds per byte from the two sizes' one-way times; never below what the large
    message's own time bounds it by, so noise cannot make the link look infinitely fast."""
    slope = (large_ms - small_ms) / (LARGE_BYTES - SMALL_BYTES)
    return max(slope, large_ms / LARGE_BYTES / 2, 1e-12)


def measure_link(
    ranks: Sequence[int], rank: int, group: dist.ProcessGroup | None, device: torch.device,
    repeats: int = 5,
) -> Link | None:
    """The slowest neighbouring pair's link, the same on every rank of ``ranks`` (global ranks
    of the pipeline, in stage order; ``rank`` is this rank's index among them); None for a
    single rank, which has no link."""
    k = len(ranks)
    if k < 2:
        return None
    found = torch.zeros(2, dtype=torch.float64)  # latency ms, ms per byte: the worst pair's
    for a in range(k - 1):
        if rank in (a, a + 1):
            times = []
            for nbytes in (SMALL_BYTES, LARGE_BYTES):
                buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
                peer = ranks[a + 1] if rank == a else ranks[a]
                times.append(_one_way_ms(buf, peer, rank == a, group, repeats))
            per_byte = _per_byte_ms(times[0], times[1])
            latency = max(times[0] - per_byte * SMALL_BYTES, 0.0)
            found = torch.maximum(found, torch.tensor([latency, per_byte], dtype=torch.float64))
        dist.barrier(group=group)
    reduced = found.to(device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    latency, per_byte = reduced.tolist()
    return Link(bandwidth_bytes_per_ms=1.0 / per_byte, latency_ms=latency, measured=True)
