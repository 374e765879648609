"""``data_parallel="auto"``: how many pipeline replicas, and how many stages, for N devices.

Every factorisation N = D × K is weighed by the D × K planner (:func:`pipecut.passes.parallel.hybrid.
plan_hybrid`) on the profiled cost table: D replicas each run the M microbatches on a D-th of
the batch, the K stages are the exact min-bottleneck split, the pipeline is simulated, and each
stage's collectives over its D replicas are added after its last backward. Each shape is
weighed under each engine of :data:`ENGINES` (DDP, ZeRO-1, FSDP2), with its memory and its
collectives; the shortest predicted step that fits wins, DDP on a tie. ZeRO-1 shards the
optimizer state, so it is chosen where DDP does not fit: such a plan wants the optimizer built
by ``pipe.optimizer(...)``. PipeDream-style uneven replica counts per stage
(:mod:`pipecut.passes.parallel.replication`) are weighed on the same model and listed when they would be
faster, as a prediction only: the runtime replicates every stage equally, so such a row is never
chosen.

:func:`choose_replicas` is pure (a cost table and numbers in, a choice out);
:func:`plan_replicas` drives it for :func:`pipecut.planning.planner.plan`, which hands it the profiling
and planning as functions: it plans the chosen K stages again at one replica's share of the
batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipecut.cluster import Link
from pipecut.core.batching import first_microbatch, split_microbatches
from pipecut.core.kinds import DataParallelKind, ScheduleKind
from pipecut.errors import InputError
from pipecut.ir import DeviceSpec, NodeCost, Plan, ReplicaCandidate
from pipecut.options import AUTO, DataParallelOptions
from pipecut.passes.parallel.hybrid import ShapeChoice, plan_hybrid, workload
from pipecut.passes.parallel.replication import ReplicationKind
from pipecut.passes.partition.solve import as_schedule
from pipecut.planning.autoplan import measurements
from pipecut.planning.request import Request

__all__ = ["ENGINES", "ReplicaChoice", "choose_replicas", "plan_replicas", "plan_replicated"]

ENGINES = (DataParallelKind.DDP, DataParallelKind.ZERO1, DataParallelKind.FSDP)
"""The replicas' engines ``data_parallel="auto"`` weighs, in the order a tie is broken."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaChoice:
    replicas: int
    stages: int
    step_ms: float
    """Predicted step of the whole batch with the chosen shape."""
    sharding: DataParallelKind
    """The replicas' engine of the chosen shape (DDP for one replica)."""
    candidates: tuple[ReplicaCandidate, ...]
    """Every shape weighed, the chosen one first, then the others by predicted step."""


def choose_replicas(
    nodes: Sequence[NodeCost],
    *,
    devices: Sequence[DeviceSpec],
    microbatches: int,
    batch_size: int,
    schedule: str | ScheduleKind,
    link: Link,
    allreduce: Link | None = None,
    per_stage: bool = True,
    shardings: Sequence[DataParallelKind] = ENGINES,
) -> ReplicaChoice:
    """Choose D replicas × K stages for ``devices`` (N equal devices) by predicted step.

    ``nodes`` is the cost table at microbatch size ``batch_size / microbatches``;
    ``allreduce`` is the link of the gradient all-reduce (default ``link``). ``per_stage``:
    also weigh uneven replica counts per stage (listed, never chosen); ``shardings``: the
    engines to weigh for each shape, in tie order. Raises PartitionError
    when no shape fits (memory, a microbatch that does not split over D replicas), naming each
    shape's reason and the fix.
    """
    n = len(devices)
    try:
        kind = ScheduleKind(schedule.value if isinstance(schedule, ScheduleKind) else str(schedule).lower())
    except ValueError:
        valid = [s.value for s in ScheduleKind]
        raise InputError(f"unknown schedule {schedule!r}; choose one of {valid}") from None
    if kind.fixed_stages_per_rank is not None:
        raise InputError(
            f"data_parallel='auto' weighs pipelines of one stage per device, but {kind.value} runs "
            f"{kind.fixed_stages_per_rank} per device (and no data-parallel engine runs its split "
            f"backward); use schedule='1f1b' or 'gpipe'"
        )
    if len({(d.memory_bytes, d.speed) for d in devices}) > 1:
        raise InputError(
            f"data_parallel='auto' weighs replicas of equal devices, but the {n} devices differ "
            f"in memory or speed ({[(d.name, d.memory_bytes, d.speed) for d in devices]}); give "
            f"equal devices, or choose the layout yourself with a ('dp', 'pp') DeviceMesh"
        )
    hybrid = plan_hybrid(
        workload(nodes), devices=n, microbatches=microbatches, batch_size=batch_size,
        schedule=kind, link=link, allreduce=allreduce or link,
        memory_bytes=devices[0].memory_bytes,
        replication=ReplicationKind.PER_STAGE if per_stage else ReplicationKind.UNIFORM,
        shardings=shardings,
    )
    best = hybrid.best
    return ReplicaChoice(
        replicas=best.replicas, stages=best.stages, step_ms=best.step_ms, sharding=best.sharding,
        candidates=_candidates(hybrid),
    )


def _candidates(hybrid: ShapeChoice) -> tuple[ReplicaCandidate, ...]:
    rows = [
        ReplicaCandidate(replicas=c.replicas, stages=c.stages, step_ms=c.step_ms,
                         sharding=c.sharding if c.replicas > 1 else None, note="chosen" if i == 0 else "")
        for i, c in enumerate(hybrid.candidates)
    ]
    rows += [
        ReplicaCandidate(replicas=s.replicas, stages=s.stages, step_ms=None, note=s.reason)
        for s in sorted(hybrid.skipped, key=lambda s: s.stages)
    ]
    uneven = hybrid.per_stage
    if uneven is not None and len(set(uneven.per_stage)) > 1:
        rows.append(ReplicaCandidate(
            replicas=max(uneven.per_stage), stages=len(uneven.per_stage), step_ms=uneven.step_ms,
            per_stage=uneven.per_stage,
            note="uneven replicas per stage: a prediction only, the runtime replicates every "
                 "stage equally",
        ))
    return tuple(rows)



def plan_replicas(
    example_inputs: Any,
    target: Any,
    *,
    devices: Sequence[DeviceSpec],
    microbatches: int,
    schedule: ScheduleKind,
    link: Link,
    profile_at: Callable[[Any, Any], Sequence[NodeCost]],
    plan_share: Callable[[Any, Any, int, DataParallelOptions], Plan],
) -> Plan:
    """``plan(..., data_parallel="auto")``: profile the first microbatch of the whole batch
    (``profile_at(first, first_target)``), choose D × K, then plan K stages at one replica's
    share of the batch (``plan_share(share, share_target, K, DataParallelOptions)``), so the plan's
    shapes are the ones the replicas run; the plan lists every shape weighed."""
    size, first = first_microbatch(example_inputs, microbatches)
    first_target = split_microbatches(target, microbatches, size, "target")[0] if target is not None else None
    choice = choose_replicas(
        profile_at(first, first_target), devices=devices, microbatches=microbatches,
        batch_size=size, schedule=schedule, link=link,
    )
    d = choice.replicas
    share = split_microbatches(example_inputs, d, size, "example_inputs")[0]
    share_target = split_microbatches(target, d, size, "target")[0] if target is not None else None
    replicated = DataParallelOptions.resolved(choice.sharding, d)
    chosen = plan_share(share, share_target, choice.stages, replicated)
    return dataclasses.replace(chosen, replica_candidates=choice.candidates)


def plan_replicated(request: Request, plan_at: Callable[[Request], Plan]) -> Plan:
    """``plan(..., data_parallel="auto")``: :func:`plan_replicas` with the request's options;
    ``plan_at`` plans one replica's share on K devices."""
    options = request.options
    wrong = [f"{name} was left out (None)" if value is None else f"{name}={value!r}"
             for name, value in (("microbatches", options.microbatches), ("schedule", options.schedule))
             if value is None or value == AUTO]
    if request.stages_per_rank != 1:
        wrong.append(f"stages_per_rank={request.stages_per_rank}")
    if options.partition.split is not None:
        wrong.append("a split")
    if wrong:
        raise InputError(
            f"data_parallel='auto' chooses replicas and stages for a given microbatch count "
            f"and schedule, but {', '.join(wrong)}: give microbatches and schedule as values (not 'auto'), "
            f"with stages_per_rank=1 and no split"
        )
    assert isinstance(options.microbatches, int) and isinstance(options.schedule, ScheduleKind)  # none was wrong

    def plan_share(share: Any, share_target: Any, k: int, replicated: DataParallelOptions) -> Plan:
        return plan_at(dataclasses.replace(request.with_options(data_parallel=replicated), example_inputs=share,
                                           target=share_target, specs=request.specs[:k]))

    return plan_replicas(
        request.example_inputs, request.target, devices=request.specs, microbatches=options.microbatches,
        schedule=as_schedule(options.schedule), link=request.link, profile_at=measurements(request).costs,
        plan_share=plan_share,
    )
