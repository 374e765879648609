"""A training run on a cluster: D replicas × K stages laid onto nodes, priced link by link.

Pure numbers, no torch. The cost table (a :class:`~pipecut.passes.costs.workload.Workload`) is at one
microbatch of ``B / M`` samples of the global batch ``B``; D replicas each run ``B / (M·D)``
samples per microbatch, so compute and activation bytes scale by ``1 / D`` (as in
:mod:`pipecut.passes.parallel.hybrid`, whose min-bottleneck split the K stages reuse). What real runs
configure, and what this model assumes of it:

* **Precision and state.** Compute in bf16 with fp32 master weights and AdamW: 16 bytes per
  parameter (fp32 weight, fp32 gradient, two fp32 moments). The cost table's ``param_bytes`` are
  the bf16 working copies (``param_dtype_bytes`` per parameter).
* **FSDP2** (``DataParallelKind.FSDP``) shards those 16 bytes over the D replicas of a stage.
  Each transformer block (an FSDP unit: a module path ``....<int>``) is all-gathered in bf16
  before its forward and its backward and its gradient reduce-scattered in fp32 after its
  backward; everything outside the blocks (embedding, final norm, head) is one more unit. A
  ring over D GPUs moves ``(D−1)/D`` of the buffer per GPU and pays ``D−1`` latencies, at the
  bandwidth of the slowest hop: inter-node as soon as the group spans nodes.
  *Overlap*, as FSDP2's prefetch does: the collectives of unit i run while unit i−1 computes
  (forward in order, backward in reverse), so only ``comm[0] + Σ max(0, comm[i] − compute[i−1])``
  is exposed. With K = 1 every microbatch gathers again (``reshard_after_forward=True``) and
  reduce-scatters; with K > 1 a stage gathers once per step and keeps its parameters and
  unsharded gradients for all microbatches (``reshard_after_forward=False``, as torchtitan runs
  PP with FSDP), reducing once after its last backward. Peak working memory: K = 1, two blocks
  gathered at once (current and prefetched, bf16 weights and fp32 gradient buffers) plus the
  root unit; K > 1, the whole stage's bf16 weights and gradients.
* **DDP** keeps all 16 bytes per parameter on every replica and all-reduces the stage's
  gradients (bf16) after its last backward, not overlapped (conservative).
* **Activation checkpointing**: ``Recompute.NONE`` keeps every saved activation; ``FULL`` keeps
  each block's input only and runs its forward again in backward (one block's activations live
  while it is recomputed); ``SELECTIVE`` does that for every second block (torchtitan's
  ``selective_ac_option = "2"``; its per-op policy costs about the same: 2,904 vs 2,973 tokens/s
  on the A100 8B run).
* **Pipeline**: the schedule is simulated action by action (:func:`pipecut.core.schedule.rank_end_ms`);
  a cut moves ``bytes / D`` over NVLink when the two GPUs share a node, else inter-node. Stage s
  keeps the schedule's in-flight microbatches of activations (1F1B: ``K − s``).
* **Metrics**: tokens/s per GPU = ``B · tokens_per_sample / step / N``; MFU = that times the model
  FLOPs per token (``6·params + attention``) over the datasheet dense bf16 peak.

Not modelled: tensor, context or expert parallelism; allocator fragmentation and the CUDA/NCCL
context (a few GiB that published peaks include); compute/communication contention on the SMs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipecut.cluster import Cluster, ClusterPlacement, Layout, Link
from pipecut.core.schedule import rank_end_ms
from pipecut.parallel import DataParallelKind
from pipecut.passes.costs.stages import inflight_microbatches
from pipecut.passes.costs.workload import Workload
from pipecut.passes.parallel.hybrid import Skipped, balanced_split, unsplittable
from pipecut.passes.schedules.standard import build
from pipecut.plan import Recompute, ScheduleKind

__all__ = [
    "STATE_BYTES_PER_PARAM",
    "RunCandidate",
    "RunChoice",
    "RunShape",
    "block_of",
    "choose_run",
    "evaluate_run",
    "exposed_ms",
    "ring_ms",
    "stage_memory",
]

STATE_BYTES_PER_PARAM = 16
"""fp32 master weight + fp32 gradient + AdamW's two fp32 moments."""
REDUCE_BYTES_PER_PARAM = 4
"""FSDP reduce-scatters gradients in fp32 (``reduce_dtype=torch.float32``)."""

_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_of(modules: Sequence[str]) -> tuple[int, ...]:
    """Per unit, the index of its transformer block (the first ``....<int>`` module prefix, in
    order of appearance), or -1 for units outside every block (the FSDP root)."""
    seen: dict[str, int] = {}
    out = []
    for m in modules:
        match = _BLOCK.match(m)
        if match is None:
            out.append(-1)
            continue
        out.append(seen.setdefault(match.group(1), len(seen)))
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunShape:
    """What the run configures, beyond the cost table."""

    batch_size: int
    """Global batch, samples (the cost table is at ``batch_size / microbatches``)."""
    microbatches: int
    tokens_per_sample: int
    model_flops_per_token: float
    """6·params + attention FLOPs per token: MFU's numerator."""
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    recompute: Recompute = Recompute.NONE
    sharding: DataParallelKind = DataParallelKind.FSDP
    param_dtype_bytes: int = 2
    """Bytes per parameter of the cost table's ``param_bytes`` (bf16: 2)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunCandidate:
    placement: ClusterPlacement
    bounds: tuple[int, ...]
    step_ms: float
    bubble_fraction: float
    compute_ms: float
    """Busy compute of the slowest stage over the step (recompute included)."""
    exposed_comm_ms: float
    """Collectives not hidden behind compute, on the stage that ends last."""
    stage_memory_bytes: tuple[int, ...]
    cut_links: tuple[str, ...]
    """Per cut: the interconnect it crosses."""
    ring_links: tuple[str, ...]
    """Per stage: the interconnect its replica ring crosses."""
    tokens_per_s_per_gpu: float
    mfu: float

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.stage_memory_bytes)


def ring_ms(nbytes: float, members: int, link: Link) -> float:
    """All-gather or reduce-scatter of ``nbytes`` (the whole buffer) over a ring of ``members``."""
    if members <= 1 or nbytes <= 0:
        return 0.0
    return (members - 1) * link.latency_ms + (members - 1) / members * nbytes / link.bandwidth_bytes_per_ms


def exposed_ms(comm: Sequence[float], compute: Sequence[float]) -> float:
    """Collective time left visible when unit i's collective overlaps unit i−1's compute."""
    if not comm:
        return 0.0
    return comm[0] + sum(max(0.0, c - compute[i - 1]) for i, c in enumerate(comm) if i)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Stage:
    """One stage at one replica's share: per FSDP unit in execution order, compute and bytes."""

    units: tuple[int, ...]
    """The FSDP units: block indices, -1 for the root (everything outside the blocks)."""
    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    recompute_ms: tuple[float, ...]
    param_bytes: tuple[int, ...]
    kept_bytes: float
    """Activations kept per microbatch until its backward."""
    transient_bytes: float
    """Activations of one block while it is recomputed."""


def _stage(work: Workload, blocks: tuple[int, ...], start: int, end: int, d: int,
           recompute: Recompute) -> _Stage:
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
    kept, transient = 0.0, 0.0
    for b in order:
        again = b >= 0 and (recompute is Recompute.FULL or (recompute is Recompute.SELECTIVE and b % 2))
        if again:
            rec[b] = fwd[b]
            kept += inputs[first[b]] / d
            transient = max(transient, act[b])
        else:
            kept += act[b]
    return _Stage(
        units=tuple(order), forward_ms=tuple(fwd[b] for b in order), backward_ms=tuple(bwd[b] for b in order),
        recompute_ms=tuple(rec[b] for b in order), param_bytes=tuple(par[b] for b in order),
        kept_bytes=kept, transient_bytes=transient,
    )


def stage_memory(stage: _Stage, *, replicas: int, stages: int, inflight: int, shape: RunShape) -> int:
    """One GPU's peak: sharded state, gathered working copies, kept and transient activations."""
    params = sum(stage.param_bytes) / shape.param_dtype_bytes
    acts = inflight * stage.kept_bytes + stage.transient_bytes
    if shape.sharding is DataParallelKind.DDP:
        return math.ceil(STATE_BYTES_PER_PARAM * params + acts)
    shard = STATE_BYTES_PER_PARAM * params / replicas
    per_param = 1 + REDUCE_BYTES_PER_PARAM / shape.param_dtype_bytes  # bf16 weight + fp32 grad
    if stages == 1:  # two blocks gathered at once (prefetch), and the root
        root = sum(p for u, p in zip(stage.units, stage.param_bytes) if u < 0)
        blocks = sorted((p for u, p in zip(stage.units, stage.param_bytes) if u >= 0), reverse=True)
        gathered = (root + sum(blocks[:2])) * per_param
    else:  # the whole stage's bf16 weights and gradients, kept over the microbatches
        gathered = 2 * sum(stage.param_bytes)
    return math.ceil(shard + gathered + acts)


def _fsdp_exposed(st: _Stage, d: int, link: Link, stages: int, kind: DataParallelKind,
                  ) -> tuple[float, float]:
    """Exposed collective ms: (per microbatch, once at the end of the step)."""
    if d <= 1:
        return 0.0, 0.0
    if kind is DataParallelKind.DDP:  # all-reduce = reduce-scatter + all-gather
        return 0.0, 2 * ring_ms(sum(st.param_bytes), d, link)
    gather = [ring_ms(p, d, link) for p in st.param_bytes]
    scatter = [ring_ms(p * REDUCE_BYTES_PER_PARAM / 2, d, link) for p in st.param_bytes]
    back = [b + r for b, r in zip(st.backward_ms, st.recompute_ms)][::-1]
    if stages == 1:  # gather in forward; gather again and reduce-scatter in backward
        fwd = exposed_ms(gather, st.forward_ms)
        bwd = exposed_ms([g + s for g, s in zip(gather[::-1], scatter[::-1])], back)
        return fwd + bwd, 0.0
    # K > 1: gathered once before the first forward, reduced once after the last backward
    return 0.0, exposed_ms(gather, st.forward_ms) + exposed_ms(scatter[::-1], back)


def evaluate_run(
    work: Workload, blocks: tuple[int, ...], shape: RunShape, cluster: Cluster, *,
    replicas: int, stages: int, layout: Layout,
) -> RunCandidate | Skipped:
    """Predict one step of ``replicas`` × ``stages`` laid out by ``layout`` on ``cluster``."""
    d, k, m = replicas, stages, shape.microbatches
    if d * k != cluster.gpus:
        return Skipped(replicas=d, stages=k, reason=f"{d} × {k} is not the cluster's {cluster.gpus} GPUs")
    unsplit = unsplittable(shape.batch_size, m, d, k)
    if unsplit is not None:
        return unsplit
    place = ClusterPlacement(layout=layout, replicas=d, stages=k)
    cut_links = tuple(
        cluster.inter if any(cluster.node_of(place.gpu(r, s)) != cluster.node_of(place.gpu(r, s + 1))
                             for r in range(d)) else cluster.intra
        for s in range(k - 1)
    )
    split = balanced_split(work, d, k, microbatches=m, schedule=shape.schedule,
                           link=cluster.intra, refine=False)
    if isinstance(split, Skipped):
        return split
    bounds, _ = split
    sts = [_stage(work, blocks, bounds[s], bounds[s + 1], d, shape.recompute) for s in range(k)]
    rings = tuple(cluster.ring_link(place.replica_group(s)) for s in range(k))
    exposed = [_fsdp_exposed(st, d, rings[s], k, shape.sharding) for s, st in enumerate(sts)]
    fwd_b = work.cut_forward_bytes or (0,) * (work.units + 1)
    bwd_b = work.cut_backward_bytes or (0,) * (work.units + 1)
    f_ms = [sum(st.forward_ms) + exposed[s][0] / 2 for s, st in enumerate(sts)]
    b_ms = [sum(st.backward_ms) + sum(st.recompute_ms) + exposed[s][0] / 2 for s, st in enumerate(sts)]
    f_link = [c.transfer_ms(math.ceil(fwd_b[bounds[s + 1]] / d)) for s, c in enumerate(cut_links)]
    b_link = [c.transfer_ms(math.ceil(bwd_b[bounds[s + 1]] / d)) for s, c in enumerate(cut_links)]
    ends = rank_end_ms(build(shape.schedule, k, m), f_ms, b_ms, f_link, b_link)
    totals = [end + exposed[s][1] for s, end in enumerate(ends)]
    step = max(totals)
    last = totals.index(step)
    busy = [m * (sum(st.forward_ms) + sum(st.backward_ms) + sum(st.recompute_ms)) for st in sts]
    span = max(ends)  # the pipeline's idle share (exposed collectives count as busy)
    bubble = 1 - sum(m * (f + b) for f, b in zip(f_ms, b_ms)) / (k * span) if span else 0.0
    inflight = inflight_microbatches(shape.schedule, k, m)
    memory = tuple(stage_memory(st, replicas=d, stages=k, inflight=inflight[s], shape=shape)
                   for s, st in enumerate(sts))
    tokens = shape.batch_size * shape.tokens_per_sample / (step / 1e3) / cluster.gpus
    return RunCandidate(
        placement=place, bounds=bounds, step_ms=step, bubble_fraction=max(0.0, bubble),
        compute_ms=max(busy), exposed_comm_ms=m * exposed[last][0] + exposed[last][1],
        stage_memory_bytes=memory, cut_links=tuple(c.name for c in cut_links),
        ring_links=tuple(c.name for c in rings), tokens_per_s_per_gpu=tokens,
        mfu=tokens * shape.model_flops_per_token / cluster.peak_flops,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RunChoice:
    candidates: tuple[RunCandidate, ...]
    """Every D × K × layout that fits, fastest first."""
    skipped: tuple[Skipped, ...]
    """Shapes that cannot run, and why (memory included)."""
    smallest_memory_bytes: int | None
    """The least peak memory per GPU of any shape (fitting or not); None if none could split."""

    @property
    def best(self) -> RunCandidate | None:
        return self.candidates[0] if self.candidates else None


def choose_run(
    work: Workload, blocks: tuple[int, ...], shape: RunShape, cluster: Cluster, *,
    replicas: int | None = None, layouts: tuple[Layout, ...] = tuple(Layout),
) -> RunChoice:
    """Every factorisation of the cluster's GPUs into D × K (or K = N / ``replicas`` only), in
    ``layouts``, ranked by predicted step; over-memory shapes are skipped with their need.
    (Memory does not depend on the layout: one layout answers "does anything fit".)"""
    n = cluster.gpus
    shapes = [(n // k, k) for k in range(1, n + 1) if n % k == 0 and k <= work.units]
    if replicas is not None:
        shapes = [(d, k) for d, k in shapes if d == replicas]
    found: list[RunCandidate] = []
    skipped: list[Skipped] = []
    least: int | None = None
    for d, k in shapes:
        for layout in layouts[:1] if d == 1 or k == 1 else layouts:
            c = evaluate_run(work, blocks, shape, cluster, replicas=d, stages=k, layout=layout)
            if isinstance(c, Skipped):
                skipped.append(c)
                continue
            least = c.peak_memory_bytes if least is None else min(least, c.peak_memory_bytes)
            if c.peak_memory_bytes > cluster.memory_bytes:
                skipped.append(Skipped(replicas=d, stages=k, reason=(
                    f"{layout.value}: needs {c.peak_memory_bytes / 2**30:.1f} GiB per GPU, "
                    f"{cluster.device} has {cluster.memory_bytes / 2**30:.1f} GiB")))
                continue
            found.append(c)
    found.sort(key=lambda c: (c.step_ms, c.placement.stages))
    return RunChoice(candidates=tuple(found), skipped=tuple(skipped), smallest_memory_bytes=least)
