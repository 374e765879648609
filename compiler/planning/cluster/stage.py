"""One stage of a cluster run at one replica's share: FSDP units, checkpointing, state, collectives.

Pure numbers, no torch; the assumptions (bf16 with fp32 AdamW state, FSDP2 units and prefetch,
activation checkpointing per block) are listed in :mod:`pipecut.planning.cluster.run`, which
prices a whole run from these pieces. A stage is seen as its FSDP units in execution order:
each transformer block (module path ``....<int>``) is one, everything outside the blocks is the
root unit (-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipecut.cluster import Link
from pipecut.core.kinds import DataParallelKind, Recompute
from pipecut.passes.costs.stages import ring_ms
from pipecut.passes.costs.workload import Workload

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "REDUCE_BYTES_PER_PARAM",
    "STATE_BYTES_PER_PARAM",
    "StageWork",
    "exposed_ms",
    "fsdp_exposed",
    "merged",
    "stage_work",
    "state_memory",
]

STATE_BYTES_PER_PARAM = 16
"""fp32 master weight + fp32 gradient + AdamW's two fp32 moments."""
OPTIMIZER_BYTES_PER_PARAM = 8
"""AdamW's two fp32 moments: the part of :data:`STATE_BYTES_PER_PARAM` ZeRO-1 shards."""
REDUCE_BYTES_PER_PARAM = 4
"""FSDP reduce-scatters gradients in fp32 (``reduce_dtype=torch.float32``)."""
DISTRIBUTED_OPTIMIZER_WHOLE_BYTES = 6
DISTRIBUTED_OPTIMIZER_SHARDED_BYTES = 12
"""Megatron's distributed optimizer, bf16 parameters and fp32 gradients: 6 + 12/D bytes per
parameter, the bf16 weight and the fp32 main gradient whole, the fp32 main weight and AdamW's
two moments sharded over the D replicas (Megatron-LM ``docs/source/api-guide/dist_optimizer.md``,
its table of bytes per parameter)."""
DISTRIBUTED_OPTIMIZER_BF16_GRADIENTS = (4, 16)
"""The same with 16-bit gradients (``grad_reduce_in_fp32=False``): 4 + 16/D, the bf16 weight and
gradient whole, the fp32 main weight, main gradient and two moments sharded (the same table's
16-bit-gradient row); the reduce-scatter moves 2 bytes a parameter instead of 4."""


def exposed_ms(comm: Sequence[float], compute: Sequence[float]) -> float:
    """Collective time left visible when unit i's collective overlaps unit i−1's compute."""
    if not comm:
        return 0.0
    return comm[0] + sum(max(0.0, c - compute[i - 1]) for i, c in enumerate(comm) if i)



@dataclass(frozen=True, kw_only=True, slots=True)
class StageWork:
    """One stage at one replica's share: per FSDP unit in execution order, compute and bytes."""

    units: tuple[int, ...]
    """The FSDP units: block indices, -1 for the root (everything outside the blocks)."""
    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    recompute_ms: tuple[float, ...]
    param_bytes: tuple[int, ...]
    kept_bytes: float
    """Activations kept per microbatch until its backward."""
    full_bytes: float
    """Activations a microbatch would keep without recompute (what a split backward's I pass
    rebuilds and keeps until W)."""
    transient_bytes: float
    """Activations of one block while it is recomputed."""
    recomputed: tuple[int, ...] = ()
    """Workload units whose forward runs again in backward."""
    held_bytes: float = 0.0
    """Bytes each microbatch's forward adds that stay until the step ends: none in pipecut's
    runtime; a published run's runtime may hold some (:mod:`pipecut.planning.cluster.foreign`)."""
    left_bytes: float = 0.0
    """Bytes each microbatch's backward leaves until the step ends (likewise)."""
    standing_bytes: float = 0.0
    """Bytes the stage holds through the whole step, whatever runs (likewise)."""


def stage_work(work: Workload, blocks: tuple[int, ...], start: int, end: int, d: int,
           recompute: Recompute) -> StageWork:
    acts = work.activation_bytes or (0,) * work.units
    inputs = work.cut_forward_bytes or (0,) * (work.units + 1)
    order: list[int] = []  # FSDP units in execution order; -1 is the root
    for u in range(start, end):
        if blocks[u] not in order:
            order.append(blocks[u])
    fwd = dict.fromkeys(order, 0.0)
    bwd = dict.fromkeys(order, 0.0)
    par = dict.fromkeys(order, 0)
    act = dict.fromkeys(order, 0.0)
    first: dict[int, int] = {}
    for u in range(start, end):
        b = blocks[u]
        fwd[b] += work.forward_ms[u] / d
        bwd[b] += work.backward_ms[u] / d
        par[b] += work.param_bytes[u]
        act[b] += acts[u] / d
        first.setdefault(b, u)
    rec = dict.fromkeys(order, 0.0)
    kept, transient, again = 0.0, 0.0, []
    for b in order:
        if b >= 0 and (recompute is Recompute.FULL or (recompute is Recompute.SELECTIVE and b % 2)):
            rec[b] = fwd[b]
            kept += inputs[first[b]] / d
            transient = max(transient, act[b])
            again.append(b)
        else:
            kept += act[b]
    return StageWork(
        units=tuple(order), forward_ms=tuple(fwd[b] for b in order), backward_ms=tuple(bwd[b] for b in order),
        recompute_ms=tuple(rec[b] for b in order), param_bytes=tuple(par[b] for b in order),
        kept_bytes=kept, full_bytes=max(kept, sum(act.values())), transient_bytes=transient,
        recomputed=tuple(u for u in range(start, end) if blocks[u] in again),
    )


def state_memory(stage: StageWork, *, replicas: int, ranks: int, sharding: DataParallelKind,
                 param_dtype_bytes: int, distributed_optimizer: bool = False, bf16_gradients: bool = False) -> float:
    """One GPU's bytes for a stage's parameters: its share of the sharded state and the working
    copies it gathers (activations aside); ``param_dtype_bytes`` per parameter of the cost
    table's ``param_bytes``. ``distributed_optimizer``: ZeRO-1 as Megatron's distributed
    optimizer holds it (:data:`DISTRIBUTED_OPTIMIZER_SHARDED_BYTES`), not as pipecut's
    ``ZeroRedundancyOptimizer`` does; ``bf16_gradients``: its 16-bit-gradient row
    (:data:`DISTRIBUTED_OPTIMIZER_BF16_GRADIENTS`)."""
    params = sum(stage.param_bytes) / param_dtype_bytes
    if sharding is DataParallelKind.DDP:
        return STATE_BYTES_PER_PARAM * params
    if sharding is DataParallelKind.ZERO1 and distributed_optimizer and bf16_gradients:
        whole, sharded = DISTRIBUTED_OPTIMIZER_BF16_GRADIENTS
        return whole * params + sharded * params / replicas
    if sharding is DataParallelKind.ZERO1 and distributed_optimizer:
        return DISTRIBUTED_OPTIMIZER_WHOLE_BYTES * params + DISTRIBUTED_OPTIMIZER_SHARDED_BYTES * params / replicas
    if sharding is DataParallelKind.ZERO1:  # weights and gradients whole, the moments a D-th
        return (STATE_BYTES_PER_PARAM - OPTIMIZER_BYTES_PER_PARAM) * params + OPTIMIZER_BYTES_PER_PARAM * params / replicas
    shard = STATE_BYTES_PER_PARAM * params / replicas
    per_param = 1 + REDUCE_BYTES_PER_PARAM / param_dtype_bytes  # bf16 weight + fp32 grad
    if ranks == 1:  # two blocks gathered at once (prefetch), and the root
        root = sum(p for u, p in zip(stage.units, stage.param_bytes) if u < 0)
        blocks = sorted((p for u, p in zip(stage.units, stage.param_bytes) if u >= 0), reverse=True)
        gathered = (root + sum(blocks[:2])) * per_param
    else:  # the whole stage's bf16 weights and its gradients, kept over the microbatches in fp32
        gathered = sum(stage.param_bytes) * per_param
    return shard + gathered


def fsdp_exposed(st: StageWork, d: int, link: Link, ranks: int, kind: DataParallelKind,
                  overlapped: bool = False, distributed_optimizer: bool = False,
                  bf16_gradients: bool = False) -> tuple[float, float]:
    """Exposed collective ms of one GPU's stages (merged in execution order): (per microbatch,
    once at the end of the step). ``overlapped`` (DDP and ZeRO-1): each unit's gradient
    reduction runs under the next unit's backward of the last microbatch, and ZeRO-1's weights
    gather under the forward, as Megatron-Core's ``--overlap-grad-reduce --overlap-param-gather``
    run them; without, both wait for the last backward (pipecut's runtime, priced conservatively).
    ``distributed_optimizer`` (ZeRO-1 as Megatron runs it): the fp32 main gradients
    reduce-scattered (bf16 with ``bf16_gradients``) and the updated bf16 weights all-gathered,
    one ring pass each."""
    if d <= 1:
        return 0.0, 0.0
    if kind in (DataParallelKind.DDP, DataParallelKind.ZERO1):
        if not overlapped:  # one collective of the stage's bytes after its last backward, as before
            reduce, weights = _replica_collectives(replace(st, param_bytes=(sum(st.param_bytes),)), d, link, kind,
                                                   distributed_optimizer, bf16_gradients)
            return 0.0, sum(reduce) + sum(weights)
        reduce, weights = _replica_collectives(st, d, link, kind, distributed_optimizer, bf16_gradients)
        back = [b + r for b, r in zip(st.backward_ms, st.recompute_ms)][::-1]
        return 0.0, exposed_ms(reduce[::-1], back) + exposed_ms(weights, st.forward_ms)
    gather = [ring_ms(p, d, link) for p in st.param_bytes]
    scatter = [ring_ms(p * REDUCE_BYTES_PER_PARAM / 2, d, link) for p in st.param_bytes]
    back = [b + r for b, r in zip(st.backward_ms, st.recompute_ms)][::-1]
    if ranks == 1:  # gather in forward; gather again and reduce-scatter in backward
        fwd = exposed_ms(gather, st.forward_ms)
        bwd = exposed_ms([g + s for g, s in zip(gather[::-1], scatter[::-1])], back)
        return fwd + bwd, 0.0
    # K > 1: gathered once before the first forward, reduced once after the last backward
    return 0.0, exposed_ms(gather, st.forward_ms) + exposed_ms(scatter[::-1], back)


def _replica_collectives(st: StageWork, d: int, link: Link, kind: DataParallelKind,
                         distributed_optimizer: bool, bf16_gradients: bool = False) -> tuple[list[float], list[float]]:
    """Per unit, the ms of the gradients' reduction and of the updated weights' gather of DDP
    (an all-reduce, no gather) or ZeRO-1 (pipecut's: the all-reduce, then each owner's fp32
    weights gathered; Megatron's distributed optimizer: the fp32 gradients reduce-scattered,
    the bf16 weights gathered; bf16 gradients with ``bf16_gradients``)."""
    if kind is DataParallelKind.ZERO1 and distributed_optimizer:
        width = 2 if bf16_gradients else REDUCE_BYTES_PER_PARAM
        return ([ring_ms(p * width / 2, d, link) for p in st.param_bytes],
                [ring_ms(p, d, link) for p in st.param_bytes])
    reduce = [2 * ring_ms(p, d, link) for p in st.param_bytes]  # all-reduce = reduce-scatter + all-gather
    if kind is DataParallelKind.DDP:
        return reduce, []
    return reduce, [ring_ms(p * REDUCE_BYTES_PER_PARAM / 2, d, link) for p in st.param_bytes]


def merged(stages: Sequence[StageWork]) -> StageWork:
    """The FSDP units of one GPU's stages, in the order their forwards first run (activations
    aside: only the collectives are priced on it)."""
    def cat(name: str) -> tuple[Any, ...]:
        return tuple(x for st in stages for x in getattr(st, name))
    return StageWork(units=cat("units"), forward_ms=cat("forward_ms"), backward_ms=cat("backward_ms"),
                     recompute_ms=cat("recompute_ms"), param_bytes=cat("param_bytes"), kept_bytes=0.0,
                     full_bytes=0.0, transient_bytes=0.0)
