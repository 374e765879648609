"""Nodes too big to run on the profiling device: estimated from their work, not measured.

A node whose weights, inputs or output do not fit where the profiler runs it (a 32k-vocabulary
head on a small GPU, one layer of a model planned for a bigger device) fails with an
out-of-memory error. Its row is then made without running it for real:

- the node runs on the meta device (shapes only, no storage), which gives its output's shape
  and dtype and, under ``FlopCounterMode``, its forward and backward FLOPs and bytes
  (:func:`pipecut.profile.flops.node_work`);
- downstream nodes get scratch values of that shape on the profiling device, so profiling goes on;
- once every node has been seen, its times are estimated from its work at the rate the
  *measured* nodes of this very run achieved (ms per FLOP over the nodes that do FLOPs, ms per
  byte for those that only move bytes), and the row is marked
  :attr:`~pipecut.core.kinds.CostSource.ESTIMATED`.

Only out-of-memory errors take this path; any other error is the user's to see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from pipecut.core.kinds import CostSource
from pipecut.core.meta import META, read_by, real_like, scratch, substitute, to_meta
from pipecut.core.torch_private import pytree
from pipecut.ir import NodeCost
from pipecut.profile.flops import NodeWork, node_work
from pipecut.profile.running import NodeRunner

__all__ = ["estimate_oversized", "is_out_of_memory", "meta_work", "stand_in"]

_CPU_OOM = ("can't allocate memory", "not enough memory", "out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """True for a device running out of memory: CUDA's OutOfMemoryError, or the CPU allocator's."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, (RuntimeError, MemoryError)) and (
        isinstance(error, MemoryError) or any(s in str(error) for s in _CPU_OOM)
    )


def meta_work(runner: NodeRunner, node: fx.Node, gm: fx.GraphModule, args: Any, kwargs: Any) -> tuple[Any, NodeWork]:
    """Run ``node`` on the meta device: its output (meta tensors) and its FLOPs and bytes."""
    margs, mkwargs = to_meta((args, kwargs))  # no-op for the meta shapes profiling keeps
    with scratch(gm, read_by(node, gm, (margs, mkwargs)), META) as stand_ins:
        margs, mkwargs = substitute((margs, mkwargs), stand_ins)
        work = node_work(runner, node, gm, margs, mkwargs)
        value = runner.call(node, margs, mkwargs)
    return value, work


def stand_in(
    runner: NodeRunner, node: fx.Node, gm: fx.GraphModule, args: Any, kwargs: Any, device: torch.device
) -> tuple[Any, NodeWork]:
    """The node's output as scratch values on ``device`` (shapes from a meta run) and its work."""
    value, work = meta_work(runner, node, gm, args, kwargs)
    generator = torch.Generator().manual_seed(0)

    def real(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        out = real_like(x, device, generator)
        return out.requires_grad_(True) if x.requires_grad and out.is_floating_point() else out

    return pytree.tree_map(real, value), work


def _rate(pairs: Sequence[tuple[float, int]]) -> float | None:
    """Milliseconds per unit of work over measured (ms, work) pairs; None without work."""
    work = sum(w for _, w in pairs)
    return sum(ms for ms, _ in pairs) / work if work > 0 else None


def estimate_oversized(
    rows: Sequence[NodeCost], measured: Mapping[str, NodeWork], oversized: Mapping[str, NodeWork]
) -> tuple[NodeCost, ...]:
    """``rows`` with the ``oversized`` nodes' times estimated at the rates the ``measured``
    nodes achieved (by FLOPs where the node does FLOPs, by bytes otherwise), marked estimated."""
    by_name = {r.name: r for r in rows}
    pairs = [(by_name[n], w) for n, w in measured.items() if n in by_name]
    rates = {
        ("forward", True): _rate([(r.forward_ms, w.forward_flops) for r, w in pairs if w.forward_flops]),
        ("forward", False): _rate([(r.forward_ms, w.forward_bytes) for r, w in pairs if not w.forward_flops]),
        ("backward", True): _rate([(r.backward_ms, w.backward_flops) for r, w in pairs if w.backward_flops]),
        ("backward", False): _rate([(r.backward_ms, w.backward_bytes) for r, w in pairs if not w.backward_flops]),
    }

    def ms(direction: str, flops: int, nbytes: int) -> float:
        by_flops, by_bytes = rates[(direction, True)], rates[(direction, False)]
        if flops and by_flops is not None:
            return by_flops * flops
        if by_bytes is not None:
            return by_bytes * nbytes
        return by_flops * flops if by_flops is not None else 0.0

    out = []
    for row in rows:
        work = oversized.get(row.name)
        if work is None:
            out.append(row)
            continue
        out.append(dataclasses.replace(
            row,
            forward_ms=ms("forward", work.forward_flops, work.forward_bytes),
            backward_ms=ms("backward", work.backward_flops, work.backward_bytes),
            source=CostSource.ESTIMATED,
        ))
    return tuple(out)
