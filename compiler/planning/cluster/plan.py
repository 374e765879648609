"""Plan a real-size training run for a cluster that is not here: ``"8x8xH100-SXM"``.

:func:`plan_cluster` is the planner's flow, one named step after another, each handing its
result down:

1. **resolve the figures** (:func:`~pipecut.planning.cluster.figures.figures_of`): the cluster,
   its links and its device's per-op model, once;
2. **price the table** (:func:`~pipecut.planning.cluster.tables.priced_table`): the model's
   cost table estimated for the device (the model may be on meta), at one microbatch of the
   global batch, at the figures' values and again at both ends of their range;
3. **shard by T** (:mod:`~pipecut.planning.cluster.tables`): the sizes T the model and a node
   allow, and each size's table at one GPU's share, at each end;
4. **evaluate runs and choose** (:mod:`~pipecut.planning.cluster.choose`): every D × T × K ×
   layout × schedule × engine on the training-run model of :mod:`~pipecut.planning.cluster.run`
   (bf16 with fp32 AdamW state, activation checkpointing, the link each cut and ring crosses),
   the fastest that fits, and its step at both ends;
5. **make the plan** (:mod:`~pipecut.planning.cluster.run_plan`): one replica of the chosen run,
   on the replica's graph (captured and counted at its share of the batch, which ``compile``
   replays; its nodes priced as the run prices a replica, not priced again), its stages the
   run's, with the cluster, the placement and the run's prediction (step at the figures' value
   and at both ends of their spread, bubble, tokens/s per GPU, MFU, memory).

Costs: the per-op model of :mod:`pipecut.profile.hardware` (matrix products by shape, attention by
kernel, memory-bound ops, launch overhead, NCCL bus bandwidth and latency per link), each figure
with its source; one residual per device family, fitted on one named published run
(``benchmarks/validation_runs.json``'s split); every other published run is a check
(``benchmarks/cluster.py``, ``tests/unit/test_validation_runs.py``). Families without hardware
figures fall back to the roofline at :data:`pipecut.profile.devices.COMPUTE_EFFICIENCY`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from pipecut.cluster import Cluster, MemoryPart, RunPrediction, StepPart
from pipecut.core.batching import first_microbatch, split_microbatches
from pipecut.core.choices import enum_choice
from pipecut.core.kinds import DataParallelKind, Recompute, ScheduleKind
from pipecut.core.program import Inputs
from pipecut.ir import NodeCost, Plan, ReplicaCandidate, ScheduleCandidate
from pipecut.options import (
    AUTO,
    DataParallelOptions,
    MeasureOptions,
    Options,
    PartitionOptions,
    ScheduleOptions,
    TensorParallelOptions,
)
from pipecut.passes.parallel.tensor import ShardedTable
from pipecut.planning.asked import NO_REPLICAS, Context, resolve
from pipecut.planning.cluster.choose import fastest_engine, step_at
from pipecut.planning.cluster.figures import Figures, figures_of
from pipecut.planning.cluster.run import RunCandidate, RunChoice, RunShape
from pipecut.planning.cluster.run_plan import mixed_links_note, plan_of_run
from pipecut.planning.cluster.tables import (
    priced_at,
    priced_table,
    sharded_tables,
    tensor_parallel_sizes,
)
from pipecut.planning.replicas import ENGINES
from pipecut.planning.tensor_parallel import head_counts
from pipecut.profile.devices import count_captured
from pipecut.profile.hardware import FigureEnd, memory_overheads
from pipecut.profile.nodes import LossFn

__all__ = ["NOT_MODELLED", "SCHEDULES", "model_flops_per_token", "plan_asked_cluster", "plan_cluster", "tensor_note"]

NOT_MODELLED = (
    "context and expert parallelism are not planned (context parallelism is priced for published runs: "
    "pipecut.planning.cluster.context)",
    "ZeRO-2 (gradients reduce-scattered as well as the optimizer state sharded, parameters whole) is "
    f"not one of pipecut's data-parallel kinds ({', '.join(k.value for k in DataParallelKind)}): not planned "
    "(with pipeline stages it costs a reduce-scatter per microbatch; DeepSpeed's pipeline engine refuses it); "
    "Megatron's distributed optimizer is priced as the megatron framework's zero1",
)

SCHEDULES = (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED_1F1B,
             ScheduleKind.ZERO_BUBBLE, ScheduleKind.ZBV)
"""What ``schedule="auto"`` weighs for a cluster (interleaved 1F1B with each of its stages per rank)."""



def model_flops_per_token(nodes: Sequence[NodeCost], *, layers: int = 0, hidden: int = 0,
                          seq: int = 0, param_dtype_bytes: int = 2) -> float:
    """``6·params + 12·layers·hidden·seq`` (torchtitan's count): params without the input
    embedding (a lookup, no product), attention scores and values for every token pair."""
    lookups = {i for n in nodes if "embedding" in n.target for i in n.inputs}
    params = sum(n.param_bytes for n in nodes
                 if n.name not in lookups and "embedding" not in n.target) / param_dtype_bytes
    return 6 * params + 12 * layers * hidden * seq


def _attention_dims(model: torch.nn.Module) -> tuple[int, int]:
    """(layers, hidden) from a Hugging Face config, else (0, 0): attention not counted."""
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "num_hidden_layers", 0) or 0), int(getattr(cfg, "hidden_size", 0) or 0)


def plan_cluster(
    model: torch.nn.Module,
    example_inputs: Inputs,
    cluster: str | Cluster,
    *,
    loss_fn: LossFn | None = None,
    target: Any = None,
    microbatches: int | None = None,
    schedule: str | ScheduleKind | None = None,
    partition: PartitionOptions | None = None,
    scheduling: ScheduleOptions | None = None,
    data_parallel: DataParallelOptions | DataParallelKind | str | None = None,
    tensor_parallel: TensorParallelOptions | int | str = AUTO,
    measure: MeasureOptions | None = None,
) -> Plan:
    """Plan ``model`` (on meta is fine) for ``cluster`` with one global batch ``example_inputs``,
    from the option objects ``pipecut.plan`` takes, resolved as a cluster plan resolves them
    (:data:`~pipecut.planning.asked.DEFAULTS`; ``plan(cluster=...)`` comes here with its own).

    ``microbatches``: the count (None: 1). ``schedule``: one schedule (None: 1F1B), or "auto"
    to weigh all of :data:`SCHEDULES` and keep the fastest run that fits.
    ``scheduling.stages_per_rank``: interleaved 1F1B's V (None weighs 2 and every V that
    divides the blocks evenly). ``partition.recompute``: the activation checkpointing every
    stage uses (none, selective, full; "auto": selective). ``data_parallel``: the replicas'
    engine (``ddp``, ``zero1``, ``fsdp``; None or "auto" weighs all of
    :data:`~pipecut.planning.replicas.ENGINES` and keeps the fastest run that fits, DDP on a
    tie) and their count D (``DataParallelOptions(replicas=D)``; None weighs every D × K).
    ``tensor_parallel``: a size T (1: none), "auto" (every T that divides a node's GPUs and the
    attention and KV heads; each T-way group stays inside a node,
    :mod:`pipecut.planning.tensor_parallel`) or :class:`~pipecut.options.TensorParallelOptions`,
    whose ``sequence_parallel`` splits the residual stream along the sequence with T > 1 (None:
    on, torchtitan's default; False prices Megatron's all-reduces). ``measure.framework``: the
    training framework whose run is priced (None: pipecut's own;
    :mod:`pipecut.planning.cluster.frameworks`), named in ``plan.run.framework``; the rest of ``measure`` goes unused. The returned plan is one
    replica of the chosen run at its share of the batch, its stages priced as the run is
    (:mod:`pipecut.planning.cluster.run_plan`); ``plan.run`` is the whole run's prediction,
    ``plan.placement`` where each pipeline rank of each replica sits, ``plan.replica_candidates``
    every shape weighed for the chosen schedule and, with "auto", ``plan.candidates`` the best
    run of every schedule."""
    options = Options(microbatches=microbatches, schedule=schedule,  # type: ignore[arg-type]  # a name, normalised
                      partition=partition or PartitionOptions(),
                      scheduling=scheduling or ScheduleOptions(), data_parallel=DataParallelOptions.of(data_parallel),
                      tensor_parallel=TensorParallelOptions.of(tensor_parallel),
                      measure=measure or MeasureOptions())
    return plan_asked_cluster(model, example_inputs, cluster, options, loss_fn=loss_fn, target=target)


def plan_asked_cluster(model: torch.nn.Module, example_inputs: Inputs, cluster: str | Cluster, options: Options, *,
                       loss_fn: LossFn | None = None, target: Any = None) -> Plan:
    """:func:`plan_cluster` of ``options`` as given (``plan(cluster=...)``'s)."""
    asked = resolve(options, Context.CLUSTER)
    microbatches, schedule, recompute = asked.microbatches, asked.schedule, asked.recompute
    sequence_parallel = asked.sequence_parallel
    stages_per_rank = None if asked.stages_per_rank == AUTO else asked.stages_per_rank
    assert isinstance(microbatches, int) and recompute != AUTO  # resolve: a cluster plan fixes both
    kinds, rec, engines = _choices(schedule, recompute, asked.data_parallel)
    size, first = first_microbatch(example_inputs, microbatches)
    # 1. resolve the figures: the cluster and its device at their values, and at both ends
    figures = figures_of(cluster, asked.framework)
    ends = tuple(figures.at(end) for end in (FigureEnd.FAST, FigureEnd.SLOW)) if figures.model is not None else ()
    # 2. price the table, and 3. shard it by T: at the figures' values and at both ends
    whole = priced_table(model, example_inputs, target, figures, microbatches, loss_fn)
    sizes = tensor_parallel_sizes(options.tensor_parallel.size or AUTO, whole.nodes, figures.cluster, head_counts(model))
    sharded = _sharded(whole.nodes, sizes, figures, whole.counted, sequence_parallel)
    spread = [(f, rows, _sharded(rows, sizes, f, whole.counted, sequence_parallel))
              for f, rows in ((f, priced_at(whole, f.model)) for f in ends if f.model is not None and whole.counted)]
    # 4. evaluate runs and choose; the chosen run at both ends
    shape = dataclasses.replace(  # as the framework runs it: pipecut's own runtime changes nothing
        _run_shape(model, whole.nodes, first, size, microbatches, schedule=kinds[0], stages_per_rank=stages_per_rank,
                   recompute=rec, sequence_parallel=sequence_parallel), **figures.framework.run_terms())
    best, choice, shard = fastest_engine(whole.nodes, figures.cluster, shape, engines, schedules=kinds,
                                         tensor_parallel=sizes, sharded=sharded,
                                         replicas=options.data_parallel.replicas)
    shape = dataclasses.replace(shape, sharding=shard)
    steps = [step_at(best, shape, rows, tables, f.cluster) for f, rows, tables in spread]
    # 5. make the plan: one replica's graph, captured and counted at its share (compile replays it),
    # cut as the run is and priced as the run prices a replica (not priced again)
    d, t = best.placement.replicas, best.placement.tensor_parallel
    captured, counted, _ = count_captured(
        model, split_microbatches(example_inputs, d, size, "example_inputs")[0], microbatches=microbatches,
        loss_fn=loss_fn, target=split_microbatches(target, d, size, "target")[0] if target is not None else None)
    planned = plan_of_run(counted, sharded[t].nodes if t > 1 else whole.nodes, best, cluster=figures.cluster,
                          captured=captured, microbatches=microbatches, batch_size=size // d, recompute=rec,
                          sharding=shard)
    run = _run_prediction(best, figures, rec, shard, has_config=bool(_attention_dims(model)[0]),
                          sequence_parallel=sequence_parallel and t > 1)
    if steps:  # the same run at both ends of the figures' spread
        run = dataclasses.replace(run, step_low_ms=min(steps[0], best.step_ms), step_high_ms=max(steps[1], best.step_ms))
    return dataclasses.replace(planned, cluster=figures.cluster, placement=best.placement, run=run,
                               replica_candidates=_candidates(choice, best),
                               candidates=_schedule_candidates(choice, best, kinds, microbatches))


def _run_shape(model: torch.nn.Module, nodes: Sequence[NodeCost], first: Inputs, size: int, microbatches: int, *,
               schedule: ScheduleKind, stages_per_rank: int | None, recompute: Recompute,
               sequence_parallel: bool) -> RunShape:
    """What every run weighed shares: the batch, its tokens, the model's FLOPs per token (for
    MFU), the parameters' width, the memory beyond the tensors."""
    seq = _sequence_length(first)
    layers, hidden = _attention_dims(model)
    width = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 2)
    flops = model_flops_per_token(nodes, layers=layers, hidden=hidden, seq=seq, param_dtype_bytes=width)
    return RunShape(batch_size=size, microbatches=microbatches, tokens_per_sample=seq, model_flops_per_token=flops,
                    schedule=schedule, stages_per_rank=stages_per_rank, recompute=recompute,
                    param_dtype_bytes=width, sequence_parallel=sequence_parallel, **_overheads())


def _overheads() -> dict[str, Any]:
    """The memory a GPU holds beyond its tensors, from the figures (``memory_overheads``): the
    CUDA context and NCCL's buffers in bytes, the allocator's reserve as a fraction."""
    per = memory_overheads(1.0)  # the reserve of one byte of tensors: the fraction
    return {"fixed_memory_bytes": math.ceil(per["context"] + per["nccl"]), "reserve_fraction": per["fragmentation"]}


def _sharded(rows: Sequence[NodeCost], sizes: Sequence[int], figures: Figures, counted: Any,
             sequence_parallel: bool) -> dict[int, ShardedTable]:
    """``rows`` at one GPU's share of each T in ``sizes``, on ``figures`` and as their framework
    runs tensor parallelism (async or not; sequence parallelism's inputs kept gathered or gathered
    again: :func:`~pipecut.planning.cluster.tables.sharded_tables`)."""
    return sharded_tables(rows, sizes, figures.cluster, sequence_parallel=sequence_parallel, model=figures.model,
                          counted=counted, overlapped=figures.tensor_overlapped, regather=figures.framework.regathers)


def _choices(
    schedule: ScheduleKind | str, recompute: Recompute, sharding: DataParallelKind | str,
) -> tuple[tuple[ScheduleKind, ...], Recompute, tuple[DataParallelKind, ...]]:
    """The resolved options as what is weighed: the schedules (one, or all for "auto") and the
    replicas' engines (one, or all for "auto")."""
    kinds = SCHEDULES if schedule == AUTO else (enum_choice(ScheduleKind, schedule, "schedule"),)
    assert sharding != NO_REPLICAS, "a cluster plan resolves left-out replicas to 'auto'"
    shard = ENGINES if sharding == AUTO else (enum_choice(DataParallelKind, sharding, "data_parallel"),)
    return kinds, recompute, shard


def _run_prediction(
    best: RunCandidate, figures: Figures, rec: Recompute, shard: DataParallelKind, *, has_config: bool,
    sequence_parallel: bool = False,
) -> RunPrediction:
    """The whole run's prediction for the chosen candidate, with what it does not model."""
    notes = (figures.source, *NOT_MODELLED) + (() if has_config else (
        "attention FLOPs not counted in MFU: the model has no Hugging Face config",))
    t = best.placement.tensor_parallel
    if t > 1:
        notes += (tensor_note(t, figures.cluster, sequence_parallel, figures.tensor_overlapped),)
    mixed = mixed_links_note(figures.cluster, best)
    return RunPrediction(
        step_ms=best.step_ms, bubble_fraction=best.bubble_fraction,
        tokens_per_s_per_gpu=best.tokens_per_s_per_gpu, mfu=best.mfu,
        peak_memory_bytes=best.peak_memory_bytes, compute_ms=best.compute_ms,
        exposed_comm_ms=best.exposed_comm_ms, recompute=rec.value, sharding=shard.value,
        sequence_parallel=sequence_parallel,
        compute_efficiency=figures.efficiency, framework=figures.framework.kind,
        notes=notes + ((mixed,) if mixed else ()),
        parts=tuple(StepPart(name=n, ms=ms) for n, ms in best.parts),
        memory_parts=tuple(MemoryPart(name=_memory_term(n, shard, best.placement.replicas, t), nbytes=b)
                           for n, b in best.memory_parts),
    )


def tensor_note(t: int, cluster: Cluster, sequence_parallel: bool, overlapped: bool = False) -> str:
    """What the plan assumes of its T-way tensor parallelism, and how compile replays it."""
    how = ("reduce-scatter and all-gather (sequence parallel: norms and residuals split too)"
           if sequence_parallel else "all-reduce")
    hidden = ("hidden under its product (the framework's async tensor parallelism)" if overlapped else
              "exposed (not hidden by async tensor parallelism: a run that uses it is faster)")
    return (f"tensor parallel {t} inside each node (Megatron's pairing: q/k/v, gate/up and the LM head "
            f"column-wise, o and down row-wise, the embedding by vocabulary): two collectives forward "
            f"and two backward per block, {how}, on {cluster.intra.name}, {hidden}; pipecut.compile runs "
            f"this plan over a DeviceMesh with dimensions ('dp', 'pp', 'tp') and tp={t}")


def _memory_term(name: str, shard: DataParallelKind, replicas: int, tp: int = 1) -> str:
    """A memory part of the run model named for the reader: the state says how it is held."""
    split = f"; the split layers' 1/{tp} on each GPU of a tensor group" if tp > 1 else ""
    if name == "activations" and tp > 1:
        return f"activations (the split values' 1/{tp})"
    if name != "state":
        return name
    if replicas < 2:
        return f"parameters, gradients and AdamW state (one replica: no data-parallel sharding{split})"
    if shard is DataParallelKind.FSDP:
        return (f"parameters, gradients and AdamW state (fsdp: sharded over {replicas}, the stage's working "
                f"copies gathered{split})")
    if shard is DataParallelKind.ZERO1:
        return (f"parameters, gradients and AdamW state (zero1: weights and gradients whole, AdamW's moments "
                f"sharded over {replicas}{split})")
    return f"parameters, gradients and AdamW state (ddp: whole on each of {replicas} replicas{split})"


def _candidates(choice: RunChoice, best: RunCandidate) -> tuple[ReplicaCandidate, ...]:
    """Every D × K × layout weighed for the chosen schedule and stages per rank."""
    def same(c: Any) -> bool:
        return c.schedule is best.schedule and c.stages_per_rank == best.stages_per_rank

    rows = [ReplicaCandidate(replicas=c.placement.replicas, stages=c.placement.stages,
                             step_ms=c.step_ms, layout=c.placement.layout,
                             tensor_parallel=c.placement.tensor_parallel, note="chosen" if c is best else "")
            for c in choice.candidates if same(c)]
    rows += [ReplicaCandidate(replicas=s.replicas, stages=s.stages, step_ms=None, note=s.reason,
                              tensor_parallel=s.tensor_parallel)
             for s in choice.skipped if same(s)]
    return tuple(rows)


def _schedule_candidates(choice: RunChoice, best: RunCandidate, kinds: tuple[ScheduleKind, ...],
                         microbatches: int) -> tuple[ScheduleCandidate, ...]:
    """With several schedules weighed: the fastest run of each schedule (its shape, stages per
    rank and memory in the note), or why none fits, the chosen one marked; nothing with one
    schedule."""
    if len(kinds) < 2:
        return ()
    rows: list[ScheduleCandidate] = []
    for kind in kinds:
        fastest = next((c for c in choice.candidates if c.schedule is kind), None)  # fastest first
        if fastest is None:
            reasons = [s.reason for s in choice.skipped if s.schedule is kind]
            why = next((r for r in reasons if "GiB per GPU" in r), reasons[0] if reasons else "no shape runs it")
            rows.append(ScheduleCandidate(microbatches=microbatches, schedule=kind, step_ms=None,
                                  note=f"nothing fits or runs, e.g. {why}"))
            continue
        shape = f"{fastest.placement.replicas} x {fastest.placement.stages}" + (
            f" x TP {fastest.placement.tensor_parallel}" if fastest.placement.tensor_parallel > 1 else "") + (
            f" on {fastest.stages_per_rank} stages per rank" if fastest.stages_per_rank > 1 else "")
        rows.append(ScheduleCandidate(microbatches=microbatches, schedule=kind, step_ms=fastest.step_ms,
                              note="chosen" if fastest is best else
                              f"{shape}, peak {fastest.peak_memory_bytes / 2**30:.1f} GiB per GPU"))
    return tuple(rows)


def _sequence_length(inputs: Inputs) -> int:
    """Tokens per sample: the second dimension of the first 2-D (or more) input tensor, else 1."""
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            return int(v.shape[1])
    return 1
