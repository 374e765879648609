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
  root unit; K > 1, the whole stage's bf16 weights and its gradients, accumulated over the
  microbatches in the reduce dtype (fp32): torch's pipeline stage turns gradient sync off until
  the last backward (``PipelineStage.backward_maybe_with_nosync``) and FSDP2 then keeps the
  unsharded gradient in ``reduce_dtype`` (``FSDPParam.to_accumulated_grad_if_needed``).
* **DDP** keeps all 16 bytes per parameter on every replica and all-reduces the stage's
  gradients (bf16) after its last backward, not overlapped (conservative); with
  ``RunShape.overlapped_reduction`` (another framework's run), each unit's reduction runs under
  the next unit's backward of the last microbatch.
* **ZeRO-1** (``DataParallelKind.ZERO1``, as pipecut runs it: DDP's reduction and torch's
  ``ZeroRedundancyOptimizer``) keeps the fp32 weight and gradient whole (8 bytes) and a D-th of
  AdamW's two moments (8 / D), all-reduces as DDP does, and after the optimizer step each
  replica broadcasts the fp32 weights it updated: one all-gather of 4 bytes per parameter,
  not overlapped. (Megatron-LM's distributed optimizer reduce-scatters the gradients instead
  and shards the fp32 master weights too, 6 + 12 / D bytes: another framework's run, priced
  with ``RunShape.distributed_optimizer``.)
* **Activation checkpointing**: ``Recompute.NONE`` keeps every saved activation; ``FULL`` keeps
  each block's input only and runs its forward again in backward (one block's activations live
  while it is recomputed); ``SELECTIVE`` does that for every second block (torchtitan's
  ``selective_ac_option = "2"``; its per-op policy costs about the same: 2,904 vs 2,973 tokens/s
  on the A100 8B run).
* **Pipeline**: the schedule asked for is built by the runtime's own generators and simulated
  action by action (:func:`pipecut.schedules.standard.build`,
  :func:`pipecut.schedules.simulate.rank_end_ms`), as it runs (:mod:`pipecut.planning.cluster.schedule`):
  interleaved 1F1B on V·K virtual stages (V − 1 more cuts per microbatch and per rank), zero
  bubble and ZBV with the backward split into an input and a weight pass, ZBV on 2K stages laid
  as a V. A cut moves ``bytes / D`` over NVLink when the two GPUs share a node, else inter-node
  (nothing where both stages are on one GPU). A GPU keeps the activations its schedule keeps,
  walked action by action (1F1B: ``K − s`` microbatches; split backward: until the W pass, a
  recomputed block's rebuilt activations included). ``choose_run`` with several schedules
  ranks them all by predicted step within memory.
* **Metrics**: tokens/s per GPU = ``B · tokens_per_sample / step / N``; MFU = that times the model
  FLOPs per token (``6·params + attention``) over the datasheet dense bf16 peak.

* **Another runtime**: ``RunShape.runtime_terms`` prices a published run with what its runtime
  holds beyond pipecut's (torchtitan's loss-parallel cross entropy, torch.distributed.pipelining
  keeping the last stage's outputs and a receive buffer per microbatch:
  :mod:`pipecut.planning.cluster.foreign`); by default
  none, the run is pipecut's own.

* **Memory beyond tensors**: ``RunShape.fixed_memory_bytes`` per GPU (the CUDA context and
  NCCL's buffers, outside the caching allocator) and ``RunShape.reserve_fraction`` of the tensors
  (the allocator's reserve and fragmentation) are added to every GPU's peak and so to the fit
  check; both 0 by default (the tensors alone), set from the figures by
  :func:`pipecut.planning.cluster.plan.plan_cluster`.

* **Tensor parallelism** (``RunShape.tensor_parallel`` T): each (replica, stage) runs on T GPUs of
  one node (:class:`~pipecut.cluster.ClusterPlacement`), and the workload is one GPU's share of
  the table with its collectives in its times (:mod:`pipecut.passes.parallel.tensor`): so its
  FSDP units gather and reduce 1/T of the parameters, its cuts send what one GPU holds, and the
  step's parts show the tensor group's link time apart from compute.

Not modelled: context or expert parallelism; async tensor parallelism (its collectives
overlapped with the products); compute/communication contention on the SMs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipecut.cluster import Cluster, ClusterPlacement, Layout, Link
from pipecut.core.kinds import DataParallelKind, Recompute, ScheduleKind
from pipecut.errors import InputError
from pipecut.passes.costs.workload import Workload
from pipecut.passes.parallel.hybrid import ShapeSkipped, balanced_split, unsplittable
from pipecut.planning.cluster.foreign import RuntimeTerm, with_runtime
from pipecut.planning.cluster.schedule import chunk_options, peak_activations, weight_ms
from pipecut.planning.cluster.stage import (
    StageWork,
    fsdp_exposed,
    merged,
    stage_work,
    state_memory,
)
from pipecut.schedules.format import Schedule, rank_of
from pipecut.schedules.simulate import StageCosts, rank_end_ms
from pipecut.schedules.standard import build

__all__ = [
    "RunCandidate",
    "RunChoice",
    "RunShape",
    "RunSkipped",
    "RunStage",
    "Splits",
    "block_of",
    "choose_run",
    "evaluate_run",
    "merged_choices",
    "step_parts",
]

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


_PREFERENCE = (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZERO_BUBBLE, ScheduleKind.ZBV,
               ScheduleKind.GPIPE, ScheduleKind.INTERLEAVED_1F1B)
"""Between runs predicted equally fast (one stage per replica, where every schedule is the same
work), the simpler schedule first: the order the runtime planner's "auto" breaks ties in."""


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
    stages_per_rank: int | None = None
    """Stages per pipeline rank V. None: :func:`choose_run` weighs the schedule's options
    (:func:`~pipecut.planning.cluster.schedule.chunk_options`) and :func:`evaluate_run` runs
    the smallest (interleaved 1F1B 2, ZBV its fixed 2, the others 1); a number fixes it."""
    recompute: Recompute = Recompute.NONE
    sharding: DataParallelKind = DataParallelKind.FSDP
    param_dtype_bytes: int = 2
    """Bytes per parameter of the cost table's ``param_bytes`` (bf16: 2)."""
    fixed_memory_bytes: int = 0
    """Bytes every GPU holds outside its tensors and the allocator: the CUDA context, NCCL's buffers."""
    reserve_fraction: float = 0.0
    """The caching allocator's reserve above the tensors (fragmentation), a fraction of them."""
    tensor_parallel: int = 1
    """T: the GPUs of one node that split each stage (the workload is then one GPU's share, its
    collectives included: :func:`pipecut.passes.parallel.tensor.shard_table`)."""
    sequence_parallel: bool = False
    """With T > 1: the residual stream split along the sequence (reduce-scatter and all-gather
    in place of all-reduce)."""
    runtime_terms: tuple[RuntimeTerm, ...] = ()
    """What the run's runtime holds beyond pipecut's own (none: pipecut's runtime). Set to
    price a published run as its runtime ran it (:mod:`pipecut.planning.cluster.foreign`)."""
    overlapped_reduction: bool = False
    """DDP and ZeRO-1: the replicas' gradient reduction hidden under the last microbatch's
    backward, unit by unit, and ZeRO-1's weight gather under the forward (a framework that
    overlaps them, as Megatron-Core's ``--overlap-grad-reduce --overlap-param-gather``); False
    prices pipecut's runtime, which reduces after the last backward."""
    distributed_optimizer: bool = False
    """ZeRO-1 as Megatron's distributed optimizer runs it (6 + 12/D bytes per parameter, the
    gradients reduce-scattered and the weights gathered) rather than as pipecut's
    ``ZeroRedundancyOptimizer`` (8 + 8/D, an all-reduce and an fp32 gather): a framework's run."""
    bf16_gradients: bool = False
    """With ``distributed_optimizer``: the gradients accumulated and reduce-scattered in bf16
    (Megatron's ``grad_reduce_in_fp32=False``, which NVIDIA's performance recipes set): 4 + 16/D
    bytes per parameter, half the reduce-scatter's bytes."""

    def __post_init__(self) -> None:
        if self.fixed_memory_bytes < 0 or not 0 <= self.reserve_fraction < 1:
            raise InputError(
                f"fixed_memory_bytes={self.fixed_memory_bytes}, reserve_fraction={self.reserve_fraction}: "
                f"give bytes ≥ 0 and a fraction in [0, 1)"
            )
        if self.tensor_parallel < 1:
            raise InputError(f"tensor_parallel={self.tensor_parallel}: give a size ≥ 1")
        if self.bf16_gradients and not self.distributed_optimizer:
            raise InputError("bf16_gradients=True prices Megatron's distributed optimizer with 16-bit gradients: "
                             "set distributed_optimizer=True as well (pipecut's own replicas reduce in fp32)")
        v, kind = self.stages_per_rank, self.schedule
        fixed = kind.fixed_stages_per_rank or 1
        if v is not None and (v < 1 or (kind is not ScheduleKind.INTERLEAVED_1F1B and v not in (1, fixed))):
            raise InputError(
                f"stages_per_rank={v}: {kind.value} runs {fixed} stage(s) per rank; several "
                f"need schedule interleaved-1f1b"
            )

    @property
    def chunks(self) -> int:
        """The stages per rank this run has (V)."""
        fixed = self.schedule.fixed_stages_per_rank
        if fixed is not None:
            return fixed
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule is ScheduleKind.INTERLEAVED_1F1B else 1


@dataclass(frozen=True, kw_only=True, slots=True)
class RunStage:
    """One (virtual) stage of a run at one replica's share, per microbatch: what the plan's stage
    table shows for the run."""

    start: int
    end: int
    """The stage holds the workload's units ``[start, end)``."""
    forward_ms: float
    backward_ms: float
    """Recompute included (and, with one stage per replica, half the exposed FSDP collectives
    of a microbatch in each of forward and backward)."""
    weight_ms: float
    """The W pass of a split backward, part of ``backward_ms``."""
    recompute_ms: float
    recomputed: tuple[int, ...]
    """Units whose forward runs again in backward."""
    comm_ms: float
    """Its cuts' transfers, activations forward and gradients backward."""
    activation_bytes: int
    """Activations a microbatch keeps until its backward (its W pass with a split backward)."""
    memory_bytes: int
    """Its state and gathered weights, and its activations at its GPU's peak: a GPU's stages
    add up to the GPU's peak."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunCandidate:
    placement: ClusterPlacement
    """Where each pipeline rank of each replica sits (``placement.stages`` is K, the ranks)."""
    schedule: ScheduleKind
    stages_per_rank: int
    bounds: tuple[int, ...]
    """V·K + 1 unit indices: stage s holds units ``[bounds[s], bounds[s + 1])``."""
    stages: tuple[RunStage, ...]
    step_ms: float
    bubble_fraction: float
    compute_ms: float
    """Busy compute of the slowest GPU over the step (recompute included)."""
    exposed_comm_ms: float
    """Collectives not hidden behind compute, on the GPU that ends last."""
    rank_memory_bytes: tuple[int, ...]
    """Per pipeline rank: one GPU's peak."""
    cut_links: tuple[str, ...]
    """Per cut: the interconnect it crosses ("same GPU" where both stages share one)."""
    ring_links: tuple[str, ...]
    """Per pipeline rank: the interconnect its replica ring crosses."""
    tokens_per_s_per_gpu: float
    mfu: float
    parts: tuple[tuple[str, float], ...] = ()
    """The step on the GPU that ends last, taken apart (:func:`step_parts`), largest first."""
    memory_parts: tuple[tuple[str, int], ...] = ()
    """The peak GPU's memory taken apart: ``state`` (parameters, gradients, optimizer state and
    the working copies its data-parallel kind gathers), ``activations``, then the
    ``RunShape``'s ``CUDA context and NCCL buffers`` and ``allocator reserve`` where set."""

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.rank_memory_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSkipped:
    """A D × K shape that cannot run ``schedule`` with ``stages_per_rank``, and why."""

    replicas: int
    stages: int
    reason: str
    schedule: ScheduleKind
    stages_per_rank: int
    tensor_parallel: int = 1


Splits = dict[tuple[int, int], "tuple[int, ...] | ShapeSkipped"]
"""Min-bottleneck splits by (replicas, stages): the same for every schedule and layout."""


def evaluate_run(
    work: Workload, blocks: tuple[int, ...], shape: RunShape, cluster: Cluster, *,
    replicas: int, stages: int, layout: Layout, splits: Splits | None = None,
) -> RunCandidate | ShapeSkipped:
    """Predict one step of ``replicas`` × ``stages`` pipeline ranks laid out by ``layout`` on
    ``cluster``, running ``shape.schedule`` on ``shape.chunks`` stages per rank. ``splits``
    caches the splits between calls."""
    d, k, v, t = replicas, stages, shape.chunks, shape.tensor_parallel
    refused = _refused(shape, cluster, d, k)
    if refused is not None:
        return refused
    key = (d, v * k)
    if splits is None or key not in splits:
        split = balanced_split(work, d, v * k, microbatches=shape.microbatches, schedule=shape.schedule,
                               link=cluster.intra, refine=False)
        found = split if isinstance(split, ShapeSkipped) else split[0]
        if splits is not None:
            splits[key] = found
    else:
        found = splits[key]
    if isinstance(found, ShapeSkipped):  # no memory limit here: a stage without parameters, or a value that cannot cross
        return ShapeSkipped(replicas=d, stages=k, reason=found.reason if found.reason.startswith("only ") else (
            f"no split into {v * k} stages gives every stage parameters to train: too many stages for this model"))
    sts = [with_runtime(stage_work(work, blocks, found[s], found[s + 1], d, shape.recompute), work, found[s],
                        found[s + 1], replicas=d, ranks=k, tensor_parallel=t, microbatches=shape.microbatches,
                        terms=shape.runtime_terms)
           for s in range(v * k)]
    return _priced(work, found, sts, shape, cluster,
                   ClusterPlacement(layout=layout, replicas=d, stages=k, tensor_parallel=t))


def _refused(shape: RunShape, cluster: Cluster, d: int, k: int) -> ShapeSkipped | None:
    """Why ``d`` × ``k`` cannot run ``shape`` at all, or None."""
    kind, v, m, t = shape.schedule, shape.chunks, shape.microbatches, shape.tensor_parallel
    if d * k * t != cluster.gpus:
        shown = f"{d} × {k}" + (f" × {t}" if t > 1 else "")
        return ShapeSkipped(replicas=d, stages=k, reason=f"{shown} is not the cluster's {cluster.gpus} GPUs")
    if cluster.gpus_per_node % t:
        return ShapeSkipped(replicas=d, stages=k, reason=(
            f"tensor parallelism {t} does not divide the {cluster.gpus_per_node} GPUs of a node"))
    if v > 1 and k == 1:
        return ShapeSkipped(replicas=d, stages=k, reason=f"{kind.value} on {v} stages per rank needs 2 ranks or more")
    if kind is ScheduleKind.INTERLEAVED_1F1B and v > 1 and m % k:
        return ShapeSkipped(replicas=d, stages=k, reason=(
            f"interleaved 1F1B needs the microbatches ({m}) to be a multiple of the {k} ranks"))
    return unsplittable(shape.batch_size, m, d, k)


def _cut_links(cluster: Cluster, place: ClusterPlacement, rank: Sequence[int]) -> list[Link | None]:
    """Per cut, the interconnect it crosses in the slowest replica, None where both stages run on
    one GPU (the turn of a V)."""
    out: list[Link | None] = []
    for s in range(len(rank) - 1):
        a, b = rank[s], rank[s + 1]
        across = any(cluster.node_of(place.gpu(r, a)) != cluster.node_of(place.gpu(r, b))
                     for r in range(place.replicas))
        out.append(None if a == b else cluster.inter if across else cluster.intra)
    return out


def _transfers(cuts: Sequence[Link | None], bounds: Sequence[int], d: int, nbytes: Sequence[int],
               messages: Sequence[int]) -> list[float]:
    """Per cut, ``bytes / D`` sent as its tensors, one message each, over the cut's link."""
    return [0.0 if c is None or not nbytes else c.transfer_ms(
        math.ceil(nbytes[bounds[s + 1]] / d), messages[bounds[s + 1]] if messages else 1)
        for s, c in enumerate(cuts)]


def _priced(work: Workload, bounds: tuple[int, ...], sts: Sequence[StageWork], shape: RunShape,
            cluster: Cluster, place: ClusterPlacement) -> RunCandidate:
    """Simulate the schedule on the stages' costs and walk its actions for memory."""
    d, k, m, n, kind = place.replicas, place.stages, shape.microbatches, len(sts), shape.schedule
    rank = [rank_of(s, k, kind.placement) for s in range(n)]
    mine = [[s for s in range(n) if rank[s] == r] for r in range(k)]
    rings = tuple(cluster.ring_link(place.replica_group(r)) for r in range(k))
    exposed = [fsdp_exposed(merged([sts[s] for s in mine[r]]), d, rings[r], k, shape.sharding,
                            shape.overlapped_reduction, shape.distributed_optimizer, shape.bf16_gradients)
               for r in range(k)]
    half = [exposed[rank[s]][0] / 2 for s in range(n)]  # per microbatch: only with one rank
    f_ms = [sum(st.forward_ms) + half[s] for s, st in enumerate(sts)]
    b_ms = [sum(st.backward_ms) + sum(st.recompute_ms) + half[s] for s, st in enumerate(sts)]
    w_ms = [weight_ms(work, bounds[s], bounds[s + 1], d) for s in range(n)]
    cuts = _cut_links(cluster, place, rank)
    f_link = _transfers(cuts, bounds, d, work.cut_forward_bytes, work.cut_forward_messages)
    b_link = _transfers(cuts, bounds, d, work.cut_backward_bytes, work.cut_backward_messages)
    costs = StageCosts(forward=tuple(f_ms), backward=tuple(b_ms), weight=tuple(w_ms),
                       forward_link=tuple(f_link), backward_link=tuple(b_link))
    schedule = build(kind, k, m, shape.chunks, costs)
    ends = rank_end_ms(schedule, f_ms, b_ms, f_link, b_link, w_ms)
    totals = [end + exposed[r][1] for r, end in enumerate(ends)]
    step = max(totals)
    last = totals.index(step)
    busy = [m * sum(sum(sts[s].forward_ms) + sum(sts[s].backward_ms) + sum(sts[s].recompute_ms)
                    for s in mine[r]) for r in range(k)]
    recomputed = m * sum(sum(sts[s].recompute_ms) for s in mine[last])
    collectives = m * exposed[last][0] + exposed[last][1]
    tp_ms, tp_again = _tensor_collectives(work, [sts[s] for s in mine[last]], bounds, mine[last], d)
    tp_ms, tp_again = m * tp_ms, m * tp_again
    # the cuts' share: how much sooner the step would end if they cost nothing
    free = rank_end_ms(schedule, f_ms, b_ms, (), (), w_ms) if any(f_link) or any(b_link) else ends
    cut_ms = max(0.0, step - max(end + exposed[r][1] for r, end in enumerate(free)))
    per_cut: dict[str, float] = {}
    for c, fl, bl in zip(cuts, f_link, b_link):
        if c is not None:
            per_cut[c.name] = per_cut.get(c.name, 0.0) + fl + bl
    links = {rings[last].name: collectives}
    if tp_ms > 0:
        links[f"{cluster.intra.name} (tensor parallel)"] = tp_ms
    parts = step_parts(step, compute=busy[last] - recomputed - (tp_ms - tp_again),
                       recompute=recomputed - tp_again, links=links, cuts=per_cut, cut_ms=cut_ms)
    span = max(ends)  # the pipeline's idle share (exposed collectives count as busy)
    bubble = 1 - sum(m * (f + b) for f, b in zip(f_ms, b_ms)) / (k * span) if span else 0.0
    state, live = _memory(schedule, sts, d, k, shape)
    held = [sum(state[s] + live[s] for s in mine[r]) for r in range(k)]
    memory = [_with_overheads(state[s] + live[s], len(mine[rank[s]]), shape) for s in range(n)]
    top = max(range(k), key=lambda r: sum(memory[s] for s in mine[r]))
    memory_parts = tuple((name, b) for name, b in (
        ("state", sum(state[s] for s in mine[top])), ("activations", sum(live[s] for s in mine[top])),
        ("CUDA context and NCCL buffers", shape.fixed_memory_bytes),
        ("allocator reserve", math.ceil(held[top] * shape.reserve_fraction))) if b > 0)
    comm = [(f_link[s - 1] + b_link[s - 1] if s else 0.0) + (f_link[s] + b_link[s] if s < n - 1 else 0.0)
            for s in range(n)]
    stages = tuple(
        RunStage(start=bounds[s], end=bounds[s + 1], forward_ms=f_ms[s], backward_ms=b_ms[s],
                 weight_ms=w_ms[s], recompute_ms=sum(st.recompute_ms), recomputed=st.recomputed,
                 comm_ms=comm[s], activation_bytes=math.ceil(st.kept_bytes), memory_bytes=memory[s])
        for s, st in enumerate(sts))
    tokens = shape.batch_size * shape.tokens_per_sample / (step / 1e3) / cluster.gpus
    return RunCandidate(
        placement=place, schedule=kind, stages_per_rank=shape.chunks, bounds=bounds, stages=stages,
        step_ms=step, bubble_fraction=max(0.0, bubble), compute_ms=max(busy),
        exposed_comm_ms=m * exposed[last][0] + exposed[last][1],
        rank_memory_bytes=tuple(sum(memory[s] for s in mine[r]) for r in range(k)),
        cut_links=tuple("same GPU" if c is None else c.name for c in cuts),
        ring_links=tuple(c.name for c in rings), tokens_per_s_per_gpu=tokens,
        mfu=tokens * shape.model_flops_per_token / cluster.peak_flops, parts=parts, memory_parts=memory_parts,
    )


def _tensor_collectives(work: Workload, sts: Sequence[StageWork], bounds: Sequence[int], stages: Sequence[int],
                        d: int) -> tuple[float, float]:
    """Per microbatch on one GPU holding ``stages``: (its tensor-parallel collectives in all,
    those of them that recomputed blocks run again), at one replica's share."""
    if not work.collective_forward_ms:
        return 0.0, 0.0
    total = again = 0.0
    for st, s in zip(sts, stages):
        rerun = set(st.recomputed)
        for u in range(bounds[s], bounds[s + 1]):
            f, b = work.collective_forward_ms[u] / d, work.collective_backward_ms[u] / d
            total += f + b + (f if u in rerun else 0.0)
            again += f if u in rerun else 0.0
    return total, again


def step_parts(step: float, *, compute: float, recompute: float, links: dict[str, float],
               cuts: dict[str, float], cut_ms: float) -> tuple[tuple[str, float], ...]:
    """A step of the GPU that ends last, taken apart: its ``compute`` and ``recompute``, each
    link's exposed time (``links``: collectives by ring link; ``cut_ms``, the cuts' exposed
    time, shared among the cut links in proportion to their transfer times ``cuts``) and the
    ``bubble``, what is left: waiting on other stages. Largest first; the parts add up to
    ``step``.

    >>> step_parts(10.0, compute=6.0, recompute=1.0, links={"NVLink": 1.0}, cuts={"NVLink": 2.0}, cut_ms=0.5)
    (('compute', 6.0), ('link NVLink', 1.5), ('bubble', 1.5), ('recompute', 1.0))
    """
    exposed = {f"link {name}": ms for name, ms in links.items() if ms > 0}
    total = sum(cuts.values())
    for name, ms in cuts.items():
        if total > 0 and cut_ms > 0:
            exposed[f"link {name}"] = exposed.get(f"link {name}", 0.0) + cut_ms * ms / total
    parts = {"compute": compute, "recompute": recompute, **exposed}
    parts["bubble"] = max(0.0, step - sum(parts.values()))
    return tuple(sorted(((n, v) for n, v in parts.items() if v > 0), key=lambda p: -p[1]))


def _memory(schedule: Schedule, sts: Sequence[StageWork], d: int, k: int,
            shape: RunShape) -> tuple[list[int], list[int]]:
    """Per stage: (its state on its GPU, its activations at that GPU's peak)."""
    live = peak_activations(schedule, [st.kept_bytes for st in sts],
                            [st.full_bytes - st.kept_bytes for st in sts],
                            [st.transient_bytes for st in sts], [st.held_bytes for st in sts],
                            [st.left_bytes for st in sts])
    state = [math.ceil(state_memory(st, replicas=d, ranks=k, sharding=shape.sharding,
                                    param_dtype_bytes=shape.param_dtype_bytes,
                                    distributed_optimizer=shape.distributed_optimizer,
                                    bf16_gradients=shape.bf16_gradients)) for st in sts]
    return state, [math.ceil(x + st.standing_bytes) for x, st in zip(live, sts)]


def _with_overheads(tensors: int, shared_with: int, shape: RunShape) -> int:
    """A stage's memory with its share of its GPU's overheads: the allocator's reserve on its
    tensors, and the fixed bytes split among the ``shared_with`` stages on the GPU (a GPU's
    stages still add up to its peak)."""
    return math.ceil(tensors * (1 + shape.reserve_fraction) + shape.fixed_memory_bytes / shared_with)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunChoice:
    candidates: tuple[RunCandidate, ...]
    """Every D × K × layout × schedule × V that fits, fastest first."""
    skipped: tuple[RunSkipped, ...]
    """Shapes that cannot run, and why (memory included)."""
    smallest_memory_bytes: int | None
    """The least peak memory per GPU of any shape (fitting or not); None if none could split."""

    @property
    def best(self) -> RunCandidate | None:
        return self.candidates[0] if self.candidates else None


def choose_run(
    work: Workload, blocks: tuple[int, ...], shape: RunShape, cluster: Cluster, *,
    replicas: int | None = None, layouts: tuple[Layout, ...] = tuple(Layout),
    schedules: tuple[ScheduleKind, ...] | None = None, splits: Splits | None = None, first_fit: bool = False,
) -> RunChoice:
    """Every factorisation of the cluster's GPUs into D × K × ``shape.tensor_parallel`` (or K = N
    / (T · ``replicas``) only), in
    ``layouts``, for each of ``schedules`` (default ``shape.schedule``) with each of its stages
    per rank (``shape.stages_per_rank``, or where None its
    :func:`~pipecut.planning.cluster.schedule.chunk_options`), ranked by predicted step;
    over-memory runs are skipped with their need. (Memory does not depend on the layout: one
    layout answers "does anything fit".) ``splits``: the splits of ``work`` already found, shared
    with the caller (a split depends on the work, D, the stages and the link inside a node, not
    on the replicas' engine, the schedule or the cluster's size); found ones are added.
    ``first_fit``: stop at the first run that fits (its choice holds that one run), for a caller
    that asks only whether any does."""
    t = shape.tensor_parallel
    n = cluster.gpus // t if cluster.gpus % t == 0 else 0
    shapes = [(n // k, k) for k in range(1, n + 1) if n % k == 0 and k <= work.units]
    if replicas is not None:
        shapes = [(d, k) for d, k in shapes if d == replicas]
    found: list[RunCandidate] = []
    skipped: list[RunSkipped] = []
    least: int | None = None
    splits = {} if splits is None else splits
    for kind in schedules or (shape.schedule,):
        for d, k in shapes:
            for v in _chunks(shape, kind, k, blocks):
                run = dataclasses.replace(shape, schedule=kind, stages_per_rank=v)
                for layout in layouts[:1] if d == 1 or k == 1 else layouts:
                    c = evaluate_run(work, blocks, run, cluster, replicas=d, stages=k, layout=layout,
                                     splits=splits)
                    if isinstance(c, ShapeSkipped):
                        skipped.append(RunSkipped(replicas=d, stages=k, reason=c.reason, schedule=kind,
                                                  stages_per_rank=v, tensor_parallel=t))
                        break  # the other layout has the same reason
                    least = c.peak_memory_bytes if least is None else min(least, c.peak_memory_bytes)
                    if c.peak_memory_bytes > cluster.memory_bytes:
                        skipped.append(RunSkipped(replicas=d, stages=k, schedule=kind, stages_per_rank=v,
                                                  tensor_parallel=t, reason=(
                            f"{layout.value}: needs {c.peak_memory_bytes / 2**30:.1f} GiB per GPU, "
                            f"{cluster.device} has {cluster.memory_bytes / 2**30:.1f} GiB")))
                        continue
                    found.append(c)
                    if first_fit:
                        return RunChoice(candidates=(c,), skipped=tuple(skipped), smallest_memory_bytes=least)
    found.sort(key=_rank)
    return RunChoice(candidates=tuple(found), skipped=tuple(skipped), smallest_memory_bytes=least)


def _rank(c: RunCandidate) -> tuple[float, int, int, int, int]:
    """Fastest first; between equal steps fewer stages, less tensor parallelism, the simpler
    schedule, fewer stages per rank."""
    return (float(f"{c.step_ms:.9g}"), c.placement.stages, c.placement.tensor_parallel,
            _PREFERENCE.index(c.schedule), c.stages_per_rank)


def merged_choices(choices: Sequence[RunChoice]) -> RunChoice:
    """The runs of several choices (one per tensor-parallel size) as one choice, fastest first."""
    least = [c.smallest_memory_bytes for c in choices if c.smallest_memory_bytes is not None]
    return RunChoice(candidates=tuple(sorted((r for c in choices for r in c.candidates), key=_rank)),
                     skipped=tuple(s for c in choices for s in c.skipped),
                     smallest_memory_bytes=min(least) if least else None)


def _chunks(shape: RunShape, kind: ScheduleKind, ranks: int, blocks: tuple[int, ...]) -> tuple[int, ...]:
    """The stages per rank to weigh for ``kind``: the one asked for, or its options."""
    if kind is shape.schedule and shape.stages_per_rank is not None:
        return (shape.stages_per_rank,)
    return chunk_options(kind, ranks, len({b for b in blocks if b >= 0}))
