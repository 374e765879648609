"""Plan a real-size training run for a cluster that is not here: ``"8x8xH100-SXM"``.

:func:`parse_cluster` reads ``nodes x gpus_per_node x device_profile`` into a
:class:`~pipecut.cluster.Cluster` (NVLink inside a node from the profile, the platform's
per-GPU network port between nodes). :func:`plan_cluster` estimates the model's cost table for
the device (:func:`pipecut.profile.devices.estimate_captured`, the model may be on meta), weighs every
D replicas × K stages in both layouts, for the schedule asked for (or, with ``"auto"``, every
schedule: GPipe, 1F1B, interleaved 1F1B, zero bubble, ZBV) as it runs, on the training-run model of
:mod:`pipecut.passes.parallel.training` (FSDP2, bf16 with fp32 AdamW state, activation checkpointing,
the link each cut and ring crosses), and returns the plan of one replica of the chosen run
(:mod:`pipecut.planning.run_plan`: its stages are the run's, times and memory included) with the
cluster, the placement and the run's prediction (step, bubble, tokens/s per GPU, MFU, memory).

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
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipecut.cluster import Cluster, Layout, Link, MemoryPart, RunPrediction, StepPart
from pipecut.core.batching import first_microbatch, split_microbatches
from pipecut.core.choices import enum_choice
from pipecut.core.kinds import AttentionKernel, DataParallelKind, Recompute, ScheduleKind
from pipecut.core.program import Captured, Inputs
from pipecut.errors import InputError, PartitionError
from pipecut.ir import Candidate, NodeCost, Plan, ReplicaCandidate
from pipecut.passes.costs.workload import Workload, workload
from pipecut.passes.parallel.hybrid import Skipped
from pipecut.passes.parallel.tensor import ShardedTable, shard_table
from pipecut.passes.parallel.training import (
    RunCandidate,
    RunChoice,
    RunShape,
    block_of,
    choose_run,
    evaluate_run,
    merged_choices,
)
from pipecut.passes.partition.rebuild import mark_rebuilt
from pipecut.planning.replicas import ENGINES
from pipecut.planning.run_plan import mixed_links_note, plan_of_run
from pipecut.planning.tensor_parallel import head_counts, sharded_tables, tensor_parallel_sizes
from pipecut.profile.devices import (
    LINK_LATENCY_MS,
    DeviceProfile,
    Precision,
    device_profile,
    estimate_captured,
)
from pipecut.profile.hardware import (
    FigureEnd,
    HardwareModel,
    bus_link,
    family_figures,
    hardware_model,
    memory_overheads,
)
from pipecut.profile.nodes import LossFn

__all__ = [
    "INTER_NODE_LATENCY_MS",
    "NOT_MODELLED",
    "SCHEDULES",
    "cluster_at",
    "family_efficiency",
    "family_model",
    "model_flops_per_token",
    "parse_cluster",
    "plan_cluster",
    "predict_run",
    "tensor_note",
]

INTER_NODE_LATENCY_MS = 0.02
"""20 µs per message between nodes: the order of NCCL's latency over InfiniBand."""

NOT_MODELLED = (
    "context and expert parallelism are not planned",
    "ZeRO-2 (gradients reduce-scattered as well as the optimizer state sharded, parameters whole) is "
    f"not one of pipecut's data-parallel kinds ({', '.join(k.value for k in DataParallelKind)}): not planned",
)

SCHEDULES = (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED_1F1B,
             ScheduleKind.ZERO_BUBBLE, ScheduleKind.ZBV)
"""What ``schedule="auto"`` weighs for a cluster (interleaved 1F1B with each of its stages per rank)."""

_SPEC = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*x\s*(.+?)\s*$", re.IGNORECASE)


def parse_cluster(
    spec: str | Cluster, *, inter_bytes_per_s: float | None = None,
    inter_latency_ms: float = INTER_NODE_LATENCY_MS, intra_latency_ms: float = LINK_LATENCY_MS,
) -> Cluster:
    """``"8x8xH100-SXM"``: 8 nodes of 8 GPUs of the ``H100-SXM`` profile.

    Inside a node: the profile's NVLink (``link_bytes_per_s``); between nodes: ``inter_bytes_per_s``
    per GPU (default: the profile's ``network_bytes_per_s``)."""
    if isinstance(spec, Cluster):
        return spec
    match = _SPEC.match(str(spec))
    if match is None:
        raise InputError(
            f"cannot read cluster {spec!r}: write nodes x GPUs per node x device profile, e.g. "
            f"'8x8xH100-SXM' (64 GPUs); profiles: {_profile_names()}"
        )
    nodes, per_node, name = int(match[1]), int(match[2]), match[3]
    if nodes < 1 or per_node < 1:
        raise InputError(f"cluster {spec!r}: nodes and GPUs per node must be at least 1")
    profile = device_profile(name)
    network = inter_bytes_per_s if inter_bytes_per_s is not None else profile.network_bytes_per_s
    if network <= 0:
        if nodes > 1:
            raise InputError(
                f"cluster {spec!r}: the {profile.name} profile gives no inter-node bandwidth; pass "
                f"inter_bytes_per_s (e.g. 50e9 for 400 Gb/s InfiniBand per GPU)"
            )
        network = profile.link_bytes_per_s
    intra_bw, inter_bw = profile.link_bytes_per_s, network
    if _has_figures(profile):  # NCCL's bus bandwidth and latency on each link, from the figures
        intra_bw, intra_latency_ms = bus_link(intra_bw, profile.family, inter=False)
        inter_bw, inter_latency_ms = bus_link(inter_bw, profile.family, inter=True)
    return Cluster(
        nodes=nodes, gpus_per_node=per_node, device=profile.name,
        memory_bytes=profile.memory_bytes, peak_flops=profile.peak_flops(Precision.BF16),
        intra=Link(name=profile.interconnect, bandwidth_bytes_per_ms=intra_bw / 1e3,
                           latency_ms=intra_latency_ms),
        inter=Link(name=f"network {network * 8 / 1e9:g} Gb/s per GPU",
                           bandwidth_bytes_per_ms=inter_bw / 1e3, latency_ms=inter_latency_ms),
    )


def _has_figures(profile: DeviceProfile) -> bool:
    try:
        family_figures(profile.family)
    except InputError:
        return False
    return True


def _profile_names() -> list[str]:
    from pipecut.profile.devices import device_profiles

    return [p.name for p in device_profiles()]


def family_efficiency(profile: DeviceProfile) -> tuple[float, str]:
    """(the family's residual: the fraction of dense peak a large product reaches in a run, and
    where it was fitted), or the roofline's default for a family without hardware figures."""
    from pipecut.profile.devices import COMPUTE_EFFICIENCY

    if _has_figures(profile):
        fig = family_figures(profile.family)["residual"]
        return fig.value, (f"per-op costs from the {profile.family} family's hardware figures; residual "
                           f"{fig.value:g} of dense peak, {fig.source}")
    return COMPUTE_EFFICIENCY, (
        f"compute efficiency {COMPUTE_EFFICIENCY:g}: no published run fitted for the "
        f"{profile.family or profile.name} family"
    )


def family_model(profile: DeviceProfile, *, attention: AttentionKernel = AttentionKernel.FLASH,
                 bound: FigureEnd = FigureEnd.VALUE,
                 residual: float | None = None) -> HardwareModel | None:
    """The per-op model of a device at bf16 (None for a family without hardware figures)."""
    if not _has_figures(profile):
        return None
    return hardware_model(profile.peak_flops(Precision.BF16), profile.memory_bandwidth_bytes_per_s,
                          profile.family, residual=residual, attention=attention, bound=bound)


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


def predict_run(
    nodes: Sequence[NodeCost], cluster: Cluster, shape: RunShape, *, replicas: int | None = None,
    schedules: tuple[ScheduleKind, ...] | None = None, tensor_parallel: Sequence[int] = (1,),
    sharded: Mapping[int, ShardedTable] | None = None,
) -> tuple[RunCandidate, RunChoice, Workload]:
    """The fastest fitting D × T × K × layout (× schedule of ``schedules``, default
    ``shape.schedule``, × stages per rank) for a cost table at microbatch ``B / M``, for each T
    of ``tensor_parallel`` (T > 1 on one GPU's share of the table: ``sharded[T]``, else the
    table's work divided by T, :func:`~pipecut.passes.parallel.tensor.shard_table`); refuses,
    with the memory needed per GPU and the smallest cluster of that device that fits, when none
    fits."""
    works = {t: _work_of(nodes, t, cluster, shape, sharded) for t in tensor_parallel}
    blocks = block_of(works[tensor_parallel[0]].modules or ("",) * works[tensor_parallel[0]].units)

    def choose(on: Cluster, layouts: tuple[Layout, ...] = tuple(Layout)) -> RunChoice:
        return merged_choices([choose_run(w, blocks, dataclasses.replace(shape, tensor_parallel=t), on,
                                          replicas=replicas, layouts=layouts, schedules=schedules)
                               for t, w in works.items()])

    choice = choose(cluster)
    if choice.best is not None:
        return choice.best, choice, works[choice.best.placement.tensor_parallel]
    need = choice.smallest_memory_bytes
    ways = f"pipeline × {shape.sharding.value}" + (f" × tensor parallel (T in {', '.join(map(str, works))})"
                                if max(works) > 1 else "")
    if need is None:
        reasons = "; ".join(f"D={s.replicas} K={s.stages} T={s.tensor_parallel}: {s.reason}" for s in choice.skipped)
        raise PartitionError(f"no D × T × K shape can run on {cluster.spec} ({reasons})")
    bigger = None
    for factor in (2, 4, 8, 16, 32, 64):
        wider = dataclasses.replace(cluster, nodes=cluster.nodes * factor)
        if choose(wider, (Layout.STAGES_INSIDE_NODES,)).best is not None:
            bigger = wider.spec
            break
    hint = f"the smallest {cluster.device} cluster that fits is {bigger}" if bigger else (
        f"no cluster up to {cluster.nodes * 64} nodes of {cluster.device} fits")
    raise PartitionError(
        f"the model does not fit on {cluster.spec} with {ways}: it needs at least "
        f"{need / 2**30:.1f} GiB per GPU, a {cluster.device} has {cluster.memory_bytes / 2**30:.1f} "
        f"GiB; {hint} (or use {'' if shape.recompute is Recompute.FULL else 'full activation checkpointing, '}"
        f"a smaller batch or more microbatches"
        + (", or tensor_parallel='auto'" if max(works) == 1 and cluster.gpus_per_node > 1 else "") + ")"
        + ("" if replicas is None else f"; with data_parallel={replicas} fixed")
    )


def _work_of(nodes: Sequence[NodeCost], t: int, cluster: Cluster, shape: RunShape,
             sharded: Mapping[int, ShardedTable] | None) -> Workload:
    """The workload of one GPU of a ``t``-way tensor group."""
    if t == 1:
        return workload(nodes)
    table = (sharded or {}).get(t) or shard_table(nodes, t, cluster.intra, sequence_parallel=shape.sequence_parallel)
    return workload(table.nodes, table.collectives)


def plan_cluster(
    model: torch.nn.Module,
    example_inputs: Inputs,
    cluster: str | Cluster,
    *,
    data_parallel: str | int = "auto",
    microbatches: int = 1,
    schedule: str | ScheduleKind = ScheduleKind.ONE_F_ONE_B,
    stages_per_rank: int | None = None,
    recompute: str | Recompute = Recompute.SELECTIVE,
    sharding: str | DataParallelKind = "auto",
    loss_fn: LossFn | None = None,
    target: Any = None,
    tensor_parallel: str | int = "auto",
    sequence_parallel: bool = True,
) -> Plan:
    """Plan ``model`` (on meta is fine) for ``cluster`` with one global batch ``example_inputs``.

    ``data_parallel``: "auto" weighs every D × K, an int fixes D. ``schedule``: one schedule, or
    "auto" to weigh all of :data:`SCHEDULES` and keep the fastest run that fits.
    ``stages_per_rank``: interleaved 1F1B's V (None weighs 2 and every V that divides the
    blocks evenly). ``recompute``: the activation checkpointing the run uses (none, selective,
    full). ``sharding``: the replicas' engine, ddp, zero1 or fsdp, or "auto" to weigh all three
    (:data:`~pipecut.planning.replicas.ENGINES`) and keep the fastest run that fits, DDP on a
    tie. ``tensor_parallel``: "auto" weighs every T that divides a
    node's GPUs and the attention (and KV) heads, an int fixes T (1: none); each T-way group
    stays inside a node (:mod:`pipecut.planning.tensor_parallel`). ``sequence_parallel``: with
    T > 1, the residual stream split along the sequence too (torchtitan's default; False prices
    Megatron's all-reduces). The returned plan is one replica of the chosen run at its
    share of the batch, its stages priced as the run is (:mod:`pipecut.planning.run_plan`);
    ``plan.run`` is the whole run's prediction, ``plan.placement`` where each pipeline rank of
    each replica sits, ``plan.replica_candidates`` every shape weighed for the chosen schedule and,
    with "auto", ``plan.candidates`` the best run of every schedule."""
    c = parse_cluster(cluster)
    profile = device_profile(c.device)
    efficiency, source = family_efficiency(profile)
    kinds, rec, engines = _choices(schedule, recompute, sharding, data_parallel)
    size, first = first_microbatch(example_inputs, microbatches)
    seq = _sequence_length(first)
    layers, hidden = _attention_dims(model)

    priced = _Recording(family_model(profile))

    def costs(inputs: Inputs, tgt: Any) -> tuple[Captured, tuple[NodeCost, ...]]:
        captured, rows = estimate_captured(model, inputs, profile, precision=Precision.BF16,
                                           microbatches=microbatches, loss_fn=loss_fn, target=tgt,
                                           compute_efficiency=efficiency,
                                           cost_model=priced if priced.model is not None else None)
        # Weighed against the slowest link a cut may cross (the network between nodes where
        # there are several): where sending costs less, on NVLink, both are a fraction of a ms,
        # while a mask sent between nodes costs 1.5 ms per microbatch at 8k tokens.
        return captured, mark_rebuilt(rows, c.inter if c.nodes > 1 else c.intra)

    _, nodes = costs(example_inputs, target)
    counted = priced.seen[:1]
    sizes = tensor_parallel_sizes(tensor_parallel, nodes, c, head_counts(model))
    sharded = sharded_tables(nodes, sizes, c, sequence_parallel=sequence_parallel, model=priced.model,
                             counted=counted[0] if counted else None)
    width = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 2)
    flops = model_flops_per_token(nodes, layers=layers, hidden=hidden, seq=seq, param_dtype_bytes=width)
    shape = RunShape(batch_size=size, microbatches=microbatches, tokens_per_sample=seq,
                     model_flops_per_token=flops, schedule=kinds[0], stages_per_rank=stages_per_rank,
                     recompute=rec, sharding=engines[0], param_dtype_bytes=width, sequence_parallel=sequence_parallel,
                     **_overheads())
    best, choice, shard = _fastest_engine(nodes, c, shape, engines, schedules=kinds, tensor_parallel=sizes,
                                          sharded=sharded, replicas=None if data_parallel == "auto" else int(data_parallel))
    shape = dataclasses.replace(shape, sharding=shard)
    d, t = best.placement.replicas, best.placement.tensor_parallel
    share = split_microbatches(example_inputs, d, size, "example_inputs")[0]
    share_target = split_microbatches(target, d, size, "target")[0] if target is not None else None
    captured, share_rows = costs(share, share_target)  # the graph a replica captures: the plan replays on it
    if t > 1:  # the plan's table is one GPU's share, as the run's
        share_rows = sharded_tables(share_rows, (t,), c, sequence_parallel=sequence_parallel, model=priced.model,
                                    counted=priced.seen[-1] if priced.model is not None else None)[t].nodes
    planned = plan_of_run(share_rows, sharded[t].nodes if t > 1 else nodes, best, cluster=c, captured=captured,
                          microbatches=microbatches, batch_size=size // d, recompute=rec, sharding=shard)
    run = _run_prediction(best, c, rec, shard, efficiency, source, has_config=bool(layers),
                          sequence_parallel=sequence_parallel and t > 1)
    if counted:  # the same run at both ends of the figures' spread
        low, high = (_step_at(bound, counted[0], nodes, best, c, profile, shape) for bound in (FigureEnd.FAST, FigureEnd.SLOW))
        run = dataclasses.replace(run, step_low_ms=min(low, best.step_ms), step_high_ms=max(high, best.step_ms))
    return dataclasses.replace(planned, cluster=c, placement=best.placement, run=run,
                               replica_candidates=_candidates(choice, best),
                               candidates=_schedule_candidates(choice, best, kinds, microbatches))


@dataclasses.dataclass
class _Recording:
    """A per-op model (or None) that keeps the rows and work it prices, so that the chosen run
    can be priced again with the figures at either end of their range without capturing again."""

    model: HardwareModel | None
    seen: list[tuple[tuple[NodeCost, ...], Any]] = dataclasses.field(default_factory=list)

    def price(self, rows: tuple[NodeCost, ...], work: Any) -> tuple[NodeCost, ...]:
        assert self.model is not None
        self.seen.append((rows, work))
        return self.model.price(rows, work)


def _overheads() -> dict[str, Any]:
    """The memory a GPU holds beyond its tensors, from the figures (``memory_overheads``): the
    CUDA context and NCCL's buffers in bytes, the allocator's reserve as a fraction."""
    per = memory_overheads(1.0)  # the reserve of one byte of tensors: the fraction
    return {"fixed_memory_bytes": math.ceil(per["context"] + per["nccl"]), "reserve_fraction": per["fragmentation"]}


def cluster_at(cluster: Cluster, profile: DeviceProfile, bound: FigureEnd) -> Cluster:
    """``cluster`` with both links' bus bandwidth and latency at ``bound`` of the family's
    figures (the line rates kept)."""
    links = []
    for link, inter in ((cluster.intra, False), (cluster.inter, True)):
        line = link.bandwidth_bytes_per_ms * 1e3 / bus_link(1.0, profile.family, inter=inter)[0]
        bw, latency = bus_link(line, profile.family, inter=inter, bound=bound)
        links.append(dataclasses.replace(link, bandwidth_bytes_per_ms=bw / 1e3, latency_ms=latency))
    return dataclasses.replace(cluster, intra=links[0], inter=links[1])


def _step_at(bound: FigureEnd, counted: tuple[tuple[NodeCost, ...], Any], nodes: Sequence[NodeCost], best: RunCandidate,
             cluster: Cluster, profile: DeviceProfile, shape: RunShape) -> float:
    """The step of ``best`` (its split, layout, schedule and stages per rank) with every figure
    at ``bound``: the cost table priced again, the links at that end of their range."""
    hw = family_model(profile, bound=bound)
    assert hw is not None
    rebuilt = {n.name: n.rebuilt for n in nodes}
    rows = tuple(dataclasses.replace(r, rebuilt=rebuilt.get(r.name, r.rebuilt)) for r in hw.price(*counted))
    on = cluster_at(cluster, profile, bound)
    d, k, v, t = best.placement.replicas, best.placement.stages, best.stages_per_rank, best.placement.tensor_parallel
    tables = sharded_tables(rows, (t,), on, sequence_parallel=shape.sequence_parallel, model=hw, counted=counted)
    work = workload(tables[t].nodes, tables[t].collectives) if t > 1 else workload(rows)
    run = dataclasses.replace(shape, schedule=best.schedule, stages_per_rank=v, tensor_parallel=t)
    again = evaluate_run(work, block_of(work.modules or ("",) * work.units), run, on,
                         replicas=d, stages=k, layout=best.placement.layout, splits={(d, v * k): best.bounds})
    return best.step_ms if isinstance(again, Skipped) else again.step_ms


def _fastest_engine(nodes: Sequence[NodeCost], cluster: Cluster, shape: RunShape,
                    engines: tuple[DataParallelKind, ...], **kwargs: Any,
                    ) -> tuple[RunCandidate, RunChoice, DataParallelKind]:
    """:func:`predict_run` under each of the replicas' ``engines``: the fastest run that fits
    (the earliest engine on a tie), with its engine; PartitionError naming each engine's
    reason where none fits."""
    found: list[tuple[RunCandidate, RunChoice, DataParallelKind]] = []
    errors: list[PartitionError] = []
    for kind in engines:
        try:
            best, choice, _ = predict_run(nodes, cluster, dataclasses.replace(shape, sharding=kind), **kwargs)
        except PartitionError as e:
            errors.append(e)
            continue
        found.append((best, choice, kind))
    if found:
        return min(found, key=lambda f: f[0].step_ms)  # min keeps the first of equal steps
    if len(errors) == 1:
        raise errors[0]
    raise PartitionError("under no engine of the replicas: " + "; ".join(
        f"sharding={k.value!r}: {e}" for k, e in zip(engines, errors)))


def _choices(
    schedule: str | ScheduleKind, recompute: str | Recompute, sharding: str | DataParallelKind,
    data_parallel: str | int,
) -> tuple[tuple[ScheduleKind, ...], Recompute, tuple[DataParallelKind, ...]]:
    """:func:`plan_cluster`'s options as enums (the schedules to weigh: one, or all for
    "auto"; the replicas' engines: one, or all for "auto"); InputError for one that is not."""
    kinds = SCHEDULES if schedule == "auto" else (enum_choice(ScheduleKind, schedule, "schedule"),)
    rec = enum_choice(Recompute, recompute, "recompute")
    shard = ENGINES if sharding == "auto" else (enum_choice(DataParallelKind, sharding, "sharding"),)
    if data_parallel != "auto" and not isinstance(data_parallel, int):
        raise InputError(f"data_parallel={data_parallel!r}: give 'auto' or a replica count")
    return kinds, rec, shard


def _run_prediction(
    best: RunCandidate, cluster: Cluster, rec: Recompute, shard: DataParallelKind, efficiency: float,
    source: str, *, has_config: bool, sequence_parallel: bool = False,
) -> RunPrediction:
    """The whole run's prediction for the chosen candidate, with what it does not model."""
    notes = (source, *NOT_MODELLED) + (() if has_config else (
        "attention FLOPs not counted in MFU: the model has no Hugging Face config",))
    t = best.placement.tensor_parallel
    if t > 1:
        notes += (tensor_note(t, cluster, sequence_parallel),)
    mixed = mixed_links_note(cluster, best)
    return RunPrediction(
        step_ms=best.step_ms, bubble_fraction=best.bubble_fraction,
        tokens_per_s_per_gpu=best.tokens_per_s_per_gpu, mfu=best.mfu,
        peak_memory_bytes=best.peak_memory_bytes, compute_ms=best.compute_ms,
        exposed_comm_ms=best.exposed_comm_ms, recompute=rec.value, sharding=shard.value,
        sequence_parallel=sequence_parallel,
        compute_efficiency=efficiency, notes=notes + ((mixed,) if mixed else ()),
        parts=tuple(StepPart(name=n, ms=ms) for n, ms in best.parts),
        memory_parts=tuple(MemoryPart(name=_memory_term(n, shard, best.placement.replicas, t), nbytes=b)
                           for n, b in best.memory_parts),
    )


def tensor_note(t: int, cluster: Cluster, sequence_parallel: bool) -> str:
    """What the plan assumes of its T-way tensor parallelism, and that compile does not replay it."""
    how = ("reduce-scatter and all-gather (sequence parallel: norms and residuals split too)"
           if sequence_parallel else "all-reduce")
    return (f"tensor parallel {t} inside each node (Megatron's pairing: q/k/v, gate/up and the LM head "
            f"column-wise, o and down row-wise, the embedding by vocabulary): two collectives forward "
            f"and two backward per block, {how}, on {cluster.intra.name}, exposed (not hidden by async "
            f"tensor parallelism: a run that uses it is faster); pipecut.compile does not run this cluster plan: it predicts a "
            f"run by torchtitan or Megatron-LM, or by pipecut.compile over a ('dp', 'pp', 'tp') DeviceMesh")


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
                         microbatches: int) -> tuple[Candidate, ...]:
    """With several schedules weighed: the fastest run of each schedule (its shape, stages per
    rank and memory in the note), or why none fits, the chosen one marked; nothing with one
    schedule."""
    if len(kinds) < 2:
        return ()
    rows: list[Candidate] = []
    for kind in kinds:
        fastest = next((c for c in choice.candidates if c.schedule is kind), None)  # fastest first
        if fastest is None:
            reasons = [s.reason for s in choice.skipped if s.schedule is kind]
            why = next((r for r in reasons if "GiB per GPU" in r), reasons[0] if reasons else "no shape runs it")
            rows.append(Candidate(microbatches=microbatches, schedule=kind, step_ms=None,
                                  note=f"nothing fits or runs, e.g. {why}"))
            continue
        shape = f"{fastest.placement.replicas} x {fastest.placement.stages}" + (
            f" x TP {fastest.placement.tensor_parallel}" if fastest.placement.tensor_parallel > 1 else "") + (
            f" on {fastest.stages_per_rank} stages per rank" if fastest.stages_per_rank > 1 else "")
        rows.append(Candidate(microbatches=microbatches, schedule=kind, step_ms=fastest.step_ms,
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
