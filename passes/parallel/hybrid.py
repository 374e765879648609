"""Data × pipeline parallelism: choose D replicas of a K-stage pipeline for N = D·K devices.

Pure numbers, no torch. The model, kept simple on purpose:

* The cost table is measured at microbatch size ``b = B / M`` (global batch B, M microbatches).
  With D replicas every replica runs the same M microbatches, each of ``b / D`` samples, so
  compute times and activation bytes scale **linearly** by ``1 / D``. (Real devices lose some
  efficiency on small microbatches; this model does not, so it favours large D slightly.)
  ``b`` must split into D whole samples; other D are skipped with the reason.
* The K stages of a pipeline are the exact min-bottleneck split of
  :func:`pipecut.passes.partition.memory_dp.partition_bounded` at the scaled costs (memory capacities,
  cut communication and the schedule's in-flight activations included). Above
  ``COARSE_ABOVE`` units the split is first found over module-boundary positions
  (:func:`pipecut.passes.partition.coarsen.candidate_cuts`); a D × K with no fitting split there is
  skipped as not fitting, and ``refine`` then searches every position, bounded by the coarse
  answer. (Without the coarse pass, proving that nothing fits takes a minute at 4,000 units.)
* The step of one pipeline is simulated action by action (:func:`pipecut.schedules.simulate.rank_end_ms`), with
  activations and gradients crossing each cut at ``bytes / D`` over the point-to-point link.
* After its **last backward**, stage s all-reduces its gradients across its D replicas with a
  ring: ``2·(D−1)·latency + 2·(D−1)/D · param_bytes_s / bandwidth``. The all-reduce of a stage
  overlaps the drain of the other stages but not its own backward (PyTorch DDP overlaps buckets
  with backward as well; not counting that makes the estimate conservative for large D).
  Replica groups of different stages use disjoint devices and run at the same time, so

      step = max over stages s of (end of stage s's last action + all-reduce of stage s).

* **The engine of the replicas** (``shardings``): DDP, ZeRO-1 or FSDP2, each with its memory
  (:func:`pipecut.passes.costs.stages.state_bytes`) and its collectives once per step
  (:func:`pipecut.passes.costs.stages.replica_sync_ms`: ZeRO-1 broadcasts the updated
  parameters after the all-reduce, 1.5 times its traffic). Each D × K takes the fastest
  engine that fits, the earlier in ``shardings`` on a tie (DDP before the sharded kinds: the
  same step with fewer moving parts).

* Efficiency is ``single / (N · step)`` where ``single = M · Σ (forward + backward)`` is the
  whole batch on one device (memory ignored for that reference).

Candidates are evaluated in increasing order of a lower bound on their step,
``max(T / D, M · T / (D · K))`` with ``T`` the compute of one microbatch, and one whose bound is
no better than the best step found is skipped (``prune=False`` evaluates all of them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipecut.cluster import Link
from pipecut.core.kinds import DataParallelKind, ScheduleKind
from pipecut.errors import PartitionError
from pipecut.options import DataParallelOptions
from pipecut.passes.costs.stages import inflight_microbatches, replica_sync_ms, state_bytes
from pipecut.passes.costs.stages import ring_allreduce_ms as ring_allreduce_ms
from pipecut.passes.costs.workload import Workload as Workload
from pipecut.passes.costs.workload import workload as workload
from pipecut.passes.parallel.replication import PerStageCandidate, ReplicationKind, plan_replicated
from pipecut.passes.partition.chain import boundary_ms
from pipecut.passes.partition.coarsen import candidate_cuts
from pipecut.passes.partition.memory_dp import partition_bounded
from pipecut.passes.partition.problem import Problem
from pipecut.schedules.simulate import rank_end_ms
from pipecut.schedules.standard import build

__all__ = [
    "COARSE_ABOVE",
    "ShapeCandidate",
    "ShapeChoice",
    "ShapeSkipped",
    "Workload",
    "balanced_split",
    "evaluate",
    "evaluate_engines",
    "lower_bound_ms",
    "plan_hybrid",
    "ring_allreduce_ms",
    "unsplittable",
    "workload",
]

COARSE_ABOVE = 600
"""Above this many units a coarse split (at module boundaries) first bounds the exact search."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeCandidate:
    """D replicas of a K-stage pipeline, and its predicted step."""

    replicas: int
    stages: int
    bounds: tuple[int, ...]
    """K + 1 unit indices: stage s holds units [bounds[s], bounds[s+1])."""
    forward_ms: tuple[float, ...]
    """Per stage, one microbatch of B / (D·M) samples."""
    backward_ms: tuple[float, ...]
    allreduce_ms: tuple[float, ...]
    """Per stage: its collectives over its D replicas once per step (``sharding``'s)."""
    pipeline_ms: float
    """Simulated step of one pipeline, without the all-reduce."""
    step_ms: float
    efficiency: float
    """Single-device step / (N · step): 1.0 is perfect scaling."""
    peak_memory_bytes: float
    """Largest per-device memory: parameters, gradients, optimizer state, in-flight activations."""
    sharding: DataParallelKind = DataParallelKind.DDP
    """The replicas' engine this prediction is for."""

    @property
    def devices(self) -> int:
        return self.replicas * self.stages

    @property
    def speedup(self) -> float:
        return self.efficiency * self.devices


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeSkipped:
    replicas: int
    stages: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeChoice:
    devices: int
    microbatches: int
    batch_size: int
    schedule: ScheduleKind
    single_device_ms: float
    """M microbatches of B / M samples, forward and backward, on one device."""
    candidates: tuple[ShapeCandidate, ...]
    """Evaluated candidates, best (shortest predicted step) first."""
    skipped: tuple[ShapeSkipped, ...]
    per_stage: PerStageCandidate | None = None
    """With ``ReplicationKind.PER_STAGE``: the best split with a replica count per stage."""
    per_stage_reason: str = ""
    """Why ``per_stage`` is None although it was asked for."""

    @property
    def best(self) -> ShapeCandidate:
        """The best uniform D × K candidate."""
        return self.candidates[0]

    @property
    def fastest(self) -> ShapeCandidate | PerStageCandidate:
        """The shorter predicted step of the best uniform candidate and the per-stage plan."""
        if self.per_stage is not None and self.per_stage.step_ms < self.best.step_ms:
            return self.per_stage
        return self.best


def _problem(
    work: Workload, replicas: int, stages: int, *, link: Link, memory_bytes: int | None,
    inflight: Sequence[int], sharding: DataParallelKind = DataParallelKind.DDP,
) -> Problem:
    n, d = work.units, replicas
    fwd = work.cut_forward_bytes or (0,) * (n + 1)
    bwd = work.cut_backward_bytes or (0,) * (n + 1)
    ok = work.crossable or (True,) * (n + 1)
    # The planner's cost rules at one replica's share: each cut moves 1/D of the bytes.
    boundary = boundary_ms([math.ceil(x / d) for x in fwd], [math.ceil(x / d) for x in bwd], ok, link)
    engine = DataParallelOptions.resolved(sharding, d) if d > 1 else None
    return Problem(
        compute_ms=tuple((f + b) / d for f, b in zip(work.forward_ms, work.backward_ms)),
        forward_ms=tuple(f / d for f in work.forward_ms),
        boundary_ms=tuple(boundary),
        input_bytes=tuple(x // d for x in fwd),
        fixed_bytes=tuple(state_bytes(p, engine) for p in work.param_bytes),
        activation_bytes=tuple(a // d for a in (work.activation_bytes or (0,) * n)),
        speeds=(1.0,) * stages,
        capacities=(memory_bytes,) * stages,
        inflight=tuple(inflight),
        holds_params=tuple(p > 0 for p in work.param_bytes),  # every stage trains something
    )


def balanced_split(
    work: Workload, replicas: int, stages: int, *, microbatches: int, schedule: ScheduleKind,
    link: Link, memory_bytes: int | None = None, refine: bool = True,
    sharding: DataParallelKind = DataParallelKind.DDP,
) -> tuple[tuple[int, ...], float] | ShapeSkipped:
    """The min-bottleneck split of ``work`` into ``stages`` at one of ``replicas`` replicas'
    share (its K + 1 unit bounds and the largest stage memory), or why there is none."""
    d, k = replicas, stages
    inflight = inflight_microbatches(schedule, k, microbatches)
    problem = _problem(work, d, k, link=link, memory_bytes=memory_bytes, inflight=inflight, sharding=sharding)
    cuts = problem.allowed_cuts()
    if len(cuts) < k - 1:
        return ShapeSkipped(
            replicas=d, stages=k,
            reason=f"only {len(cuts)} places to cut, {k} stages need {k - 1}",
        )
    coarse: tuple[int, ...] = ()
    if work.units > COARSE_ABOVE:
        coarse = candidate_cuts(
            work.modules or ("",) * work.units, problem.compute_ms, problem.boundary_ms,
            max_positions=max(240, 2 * k),
        )
    split = partition_bounded(problem, positions=coarse or None)
    if split is not None and coarse and refine:
        # Exact over every position, bounded by the coarse answer (so it cannot be worse).
        split = partition_bounded(problem, coarse=coarse) or split
    holders = sum(problem.holds_params)
    if split is None and 0 < holders < k:
        return ShapeSkipped(
            replicas=d, stages=k,
            reason=f"{holders} of the units hold parameters, fewer than the {k} stages (each must train one)",
        )
    if split is None or not split.fits:
        return ShapeSkipped(
            replicas=d, stages=k,
            reason=f"no split into {k} stages fits in {_gb(memory_bytes)} per device"
                   + (f" under {sharding.value}" if d > 1 else ""),
        )
    return split.bounds, max(s.memory_bytes for s in split.stages)


def evaluate(
    work: Workload,
    replicas: int,
    stages: int,
    *,
    microbatches: int,
    batch_size: int,
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
    link: Link,
    allreduce: Link,
    memory_bytes: int | None = None,
    refine: bool = True,
    sharding: DataParallelKind = DataParallelKind.DDP,
) -> ShapeCandidate | ShapeSkipped:
    """Split ``work`` into ``stages`` stages for ``replicas`` replicas under the engine
    ``sharding`` and predict its step."""
    d, k, m = replicas, stages, microbatches
    unsplit = unsplittable(batch_size, m, d, k)
    if unsplit is not None:
        return unsplit
    split = balanced_split(
        work, d, k, microbatches=m, schedule=schedule, link=link, memory_bytes=memory_bytes,
        refine=refine, sharding=sharding,
    )
    if isinstance(split, ShapeSkipped):
        return split
    b, peak = split
    fwd = work.cut_forward_bytes or (0,) * (work.units + 1)
    bwd = work.cut_backward_bytes or (0,) * (work.units + 1)
    f_ms = tuple(sum(work.forward_ms[b[s]:b[s + 1]]) / d for s in range(k))
    b_ms = tuple(sum(work.backward_ms[b[s]:b[s + 1]]) / d for s in range(k))
    f_link = [link.transfer_ms(math.ceil(fwd[c] / d)) for c in b[1:-1]]
    b_link = [link.transfer_ms(math.ceil(bwd[c] / d)) for c in b[1:-1]]
    ends = rank_end_ms(build(schedule, k, m), f_ms, b_ms, f_link, b_link)
    reduce_ms = tuple(
        replica_sync_ms(sum(work.param_bytes[b[s]:b[s + 1]]), d, allreduce, sharding) for s in range(k)
    )
    step = max(end + r for end, r in zip(ends, reduce_ms))
    single = m * work.compute_ms
    return ShapeCandidate(
        replicas=d,
        stages=k,
        bounds=b,
        forward_ms=f_ms,
        backward_ms=b_ms,
        allreduce_ms=reduce_ms,
        pipeline_ms=max(ends),
        step_ms=step,
        efficiency=single / (d * k * step) if step > 0 else 1.0,
        peak_memory_bytes=peak,
        sharding=sharding if d > 1 else DataParallelKind.DDP,
    )


def evaluate_engines(work: Workload, replicas: int, stages: int, *, shardings: Sequence[DataParallelKind],
                     **kwargs: Any) -> ShapeCandidate | ShapeSkipped:
    """:func:`evaluate` under each engine of ``shardings`` (one replica: the first only, there
    is nothing to shard); the fastest that fits, the earliest on a tie, or the first's reason."""
    found: list[ShapeCandidate] = []
    first: ShapeSkipped | None = None
    for kind in shardings[:1] if replicas == 1 else shardings:
        got = evaluate(work, replicas, stages, sharding=kind, **kwargs)
        if isinstance(got, ShapeCandidate):
            found.append(got)
        elif first is None:
            first = got
    if found:
        return min(found, key=lambda c: c.step_ms)  # min keeps the first of equal steps
    assert first is not None
    return first


def unsplittable(batch_size: int, microbatches: int, replicas: int, stages: int) -> ShapeSkipped | None:
    """Why ``replicas`` × ``stages`` cannot run a batch in ``microbatches`` (each microbatch is
    shared out over the replicas), or None if it can."""
    if batch_size % microbatches or (batch_size // microbatches) % replicas:
        return ShapeSkipped(replicas=replicas, stages=stages, reason=(
            f"a microbatch of {batch_size / microbatches:g} samples does not split over {replicas} replicas"))
    return None


def _gb(nbytes: int | None) -> str:
    return "unlimited memory" if nbytes is None else f"{nbytes / 1e9:g} GB"


def lower_bound_ms(work: Workload, replicas: int, stages: int, microbatches: int) -> float:
    """No candidate beats one microbatch's path through all stages, nor perfect balance."""
    per_mb = work.compute_ms / replicas
    return max(per_mb, microbatches * per_mb / stages)


def plan_hybrid(
    work: Workload,
    *,
    devices: int,
    microbatches: int,
    batch_size: int,
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
    link: Link,
    allreduce: Link,
    memory_bytes: int | None = None,
    prune: bool = True,
    refine: bool = True,
    replication: ReplicationKind = ReplicationKind.UNIFORM,
    shardings: Sequence[DataParallelKind] = (DataParallelKind.DDP,),
) -> ShapeChoice:
    """Every factorisation ``devices = D × K``, ranked by predicted step (best first).

    ``replication=ReplicationKind.PER_STAGE`` also runs the per-stage replication DP
    (:func:`pipecut.passes.parallel.replication.plan_replicated`) on the same cost model; the result is
    ``per_stage`` and :attr:`ShapeChoice.fastest` picks between it and the best uniform one.

    ``link``: point-to-point link between consecutive stages; ``allreduce``: the per-device
    link of the ring all-reduce inside a stage's replica group (bandwidth in bytes/ms, latency
    per ring step); ``memory_bytes``: capacity of every device, None for unlimited; ``shardings``:
    the replicas' engines to weigh for each D × K (:func:`evaluate_engines`).
    """
    _check_request(devices, microbatches, batch_size)
    found, skipped = _search(work, devices, microbatches, prune, functools.partial(
        evaluate_engines, work, shardings=tuple(shardings), microbatches=microbatches, batch_size=batch_size,
        schedule=schedule, link=link, allreduce=allreduce, memory_bytes=memory_bytes, refine=refine,
    ))
    per_stage, why = None, ""
    if replication is ReplicationKind.PER_STAGE:
        try:
            per_stage = plan_replicated(
                work, devices=devices, microbatches=microbatches, batch_size=batch_size,
                schedule=schedule, link=link, allreduce=allreduce, memory_bytes=memory_bytes,
            )
        except PartitionError as error:  # uniform candidates exist: report, do not fail
            why = str(error)
    return ShapeChoice(
        devices=devices,
        microbatches=microbatches,
        batch_size=batch_size,
        schedule=schedule,
        single_device_ms=microbatches * work.compute_ms,
        candidates=tuple(found),
        skipped=tuple(skipped),
        per_stage=per_stage,
        per_stage_reason=why,
    )


def _check_request(devices: int, microbatches: int, batch_size: int) -> None:
    if devices < 1:
        raise PartitionError(f"devices must be at least 1, got {devices}")
    if microbatches < 1 or batch_size % microbatches:
        raise PartitionError(
            f"batch size {batch_size} does not split into {microbatches} microbatches; "
            f"choose a batch size that is a multiple of the microbatch count"
        )


def _search(
    work: Workload,
    devices: int,
    microbatches: int,
    prune: bool,
    evaluate_at: Callable[[int, int], ShapeCandidate | ShapeSkipped],
) -> tuple[list[ShapeCandidate], list[ShapeSkipped]]:
    """Every ``D × K = devices`` by ``evaluate_at(D, K)``, most promising lower bound first,
    the candidates best first; with ``prune``, a shape whose bound cannot beat the best found
    is skipped. PartitionError if none runs."""
    shapes = [(devices // k, k) for k in range(1, devices + 1) if devices % k == 0]
    shapes.sort(key=lambda dk: (lower_bound_ms(work, dk[0], dk[1], microbatches), dk[1]))
    found: list[ShapeCandidate] = []
    skipped: list[ShapeSkipped] = []
    for d, k in shapes:
        bound = lower_bound_ms(work, d, k, microbatches)
        if prune and found and bound >= min(c.step_ms for c in found):
            skipped.append(ShapeSkipped(
                replicas=d, stages=k,
                reason=f"pruned: lower bound {bound:.4g} ms ≥ best step {found[0].step_ms:.4g} ms",
            ))
            continue
        result = evaluate_at(d, k)
        if isinstance(result, ShapeSkipped):
            skipped.append(result)
        else:
            found.append(result)
            found.sort(key=lambda c: (c.step_ms, c.stages))
    if not found:
        reasons = "; ".join(f"D={s.replicas} K={s.stages}: {s.reason}" for s in skipped)
        raise PartitionError(
            f"no way to run this model on {devices} devices ({reasons}); give the devices more "
            f"memory, use more devices, or change the batch size"
        )
    return found, skipped
