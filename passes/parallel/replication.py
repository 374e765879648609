"""Per-stage replication, as PipeDream does: stage boundaries and a replica count per stage.

:mod:`pipecut.passes.parallel.hybrid` gives every stage the same D replicas. Here each stage ``s`` gets
its own ``r_s ≥ 1`` with ``Σ r_s = N`` devices, so a heavy stage can take three devices and a
light one a single device. Pure numbers, no torch. The model of one stage over units ``[i, j)``
with ``r`` replicas, per microbatch of ``b = B / M`` samples:

* each replica runs ``b / r`` samples of every microbatch (``r`` must divide ``b``: a sample is
  not split; other ``r`` are never considered, see ``PerStageCandidate.replica_choices``), so
  compute and activation bytes scale by ``1 / r``;
* it receives its input cut and sends its output cut (activations forward, gradients backward),
  each replica its ``1 / r`` share, over its own point-to-point link;
* once per step its replicas all-reduce the stage's gradients with a ring
  (:func:`pipecut.passes.costs.workload.ring_allreduce_ms`), amortised over the M microbatches.

    stage_ms(i, j, r) = compute[i:j] / r + transfer(in_i / r) + transfer(out_j / r)
                        + ring(params[i:j], r) / M

The pipeline's steady state is paced by its slowest stage, so the dynamic program over (prefix
of cut positions, devices used) is

    best[j][n] = min over i < j, r ≤ n of max(best[i][n − r], stage_ms(i, j, r))

and the answer is ``best[units][N]``: exact for this objective over the searched positions
(tests compare it with brute force over every split and replica vector). With
``memory_bytes`` a replica must hold the stage's parameters, gradients and optimizer state and
``inflight / r`` microbatches of its activations, where ``inflight`` is M for GPipe and, for
1F1B, ``min(M, 1 + devices after this stage)``: an upper bound on the K − s microbatches stage
``s`` keeps, exact when the later stages are not replicated (the DP does not know K yet).

The predicted step of the chosen plan is simulated like a uniform candidate's
(:func:`pipecut.schedules.simulate.rank_end_ms`, each stage's all-reduce after its last backward; a cut between
stages of ``r`` and ``r'`` replicas moves ``bytes / min(r, r')`` per device), so the two can be
compared; ``bottleneck_ms`` is the DP's objective. Above ``max_positions`` allowed cuts the DP
runs over the module-boundary positions of :func:`pipecut.passes.partition.coarsen.candidate_cuts` only.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from pipecut.cluster import Link
from pipecut.core.kinds import ScheduleKind
from pipecut.errors import PartitionError
from pipecut.passes.costs.stages import OPTIMIZER_STATE_FACTOR, ring_allreduce_ms, state_bytes
from pipecut.passes.costs.workload import Workload
from pipecut.passes.partition.coarsen import candidate_cuts
from pipecut.schedules.simulate import rank_end_ms
from pipecut.schedules.standard import build

__all__ = [
    "PerStageCandidate",
    "ReplicationKind",
    "inflight",
    "plan_replicated",
    "stage_memory_bytes",
    "stage_ms",
]


class ReplicationKind(enum.Enum):
    UNIFORM = "uniform"
    """Every stage has the same D replicas (N = D × K)."""
    PER_STAGE = "per_stage"
    """Each stage has its own replica count (PipeDream)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PerStageCandidate:
    """K stages, stage s holding units [bounds[s], bounds[s+1]) on per_stage[s] devices."""

    devices: int
    microbatches: int
    batch_size: int
    schedule: ScheduleKind
    bounds: tuple[int, ...]
    per_stage: tuple[int, ...]
    """Replicas of each stage, in stage order."""
    forward_ms: tuple[float, ...]
    """Per stage and microbatch, on one replica (its b / r samples)."""
    backward_ms: tuple[float, ...]
    stage_ms: tuple[float, ...]
    """The DP's time per microbatch of each stage: compute, transfers, amortised all-reduce."""
    allreduce_ms: tuple[float, ...]
    """Per stage: one ring all-reduce of its gradients over its replicas (once per step)."""
    bottleneck_ms: float
    """max(stage_ms): what the DP minimises."""
    pipeline_ms: float
    """Simulated step without the all-reduces."""
    step_ms: float
    """Simulated step, each stage's all-reduce after its last backward."""
    efficiency: float
    """Single-device step / (N · step)."""
    single_device_ms: float
    peak_memory_bytes: float
    """Largest per-device memory under the DP's memory model."""
    replica_choices: tuple[int, ...]
    """Replica counts considered: divisors of the microbatch size, at most N."""
    positions: int
    """Cut positions searched (fewer than the allowed cuts when coarsened)."""

    @property
    def stages(self) -> int:
        return len(self.per_stage)

    @property
    def speedup(self) -> float:
        return self.efficiency * self.devices


def inflight(schedule: ScheduleKind, microbatches: int, devices: int, used: int) -> int:
    """Microbatches a stage keeps at once when stages up to it use ``used`` of ``devices``."""
    if schedule is ScheduleKind.GPIPE:
        return microbatches
    return min(microbatches, 1 + devices - used)


def _transfer(nbytes: np.ndarray, link: Link) -> np.ndarray:
    return np.where(nbytes > 0, link.latency_ms + nbytes / link.bandwidth_bytes_per_ms, 0.0)


def _boundary(work: Workload, replicas: int, link: Link) -> np.ndarray:
    """Per cut position (N + 1): one replica's forward + backward transfer time; inf if blocked."""
    n = work.units
    fwd = np.asarray(work.cut_forward_bytes or (0,) * (n + 1), dtype=np.float64)
    bwd = np.asarray(work.cut_backward_bytes or (0,) * (n + 1), dtype=np.float64)
    ok = np.asarray(work.crossable or (True,) * (n + 1))
    out = _transfer(np.ceil(fwd / replicas), link) + _transfer(np.ceil(bwd / replicas), link)
    out = np.where(ok, out, np.inf)
    out[0] = out[n] = 0.0
    return out


def stage_ms(
    work: Workload, start: int, end: int, replicas: int, *, microbatches: int, link: Link,
    allreduce: Link,
) -> float:
    """The DP's time per microbatch of units [start, end) on ``replicas`` devices."""
    bnd = _boundary(work, replicas, link)
    compute = sum(work.forward_ms[start:end]) + sum(work.backward_ms[start:end])
    ring = ring_allreduce_ms(sum(work.param_bytes[start:end]), replicas, allreduce)
    return float(compute / replicas + bnd[start] + bnd[end] + ring / microbatches)


def stage_memory_bytes(work: Workload, start: int, end: int, replicas: int, inflight: int) -> float:
    """One replica's parameters, gradients, optimizer state and in-flight activations."""
    fixed = state_bytes(sum(work.param_bytes[start:end]))
    inputs = (work.cut_forward_bytes or (0,) * (work.units + 1))[start]
    acts = sum((work.activation_bytes or (0,) * work.units)[start:end])
    return fixed + inflight * (inputs + acts) / replicas


def _prefix(values: tuple, n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(values or (0,) * n, dtype=np.float64))])


def _solve(
    work: Workload, pos: np.ndarray, choices: tuple[int, ...], *, devices: int, microbatches: int,
    schedule: ScheduleKind, link: Link, allreduce: Link, memory_bytes: int | None,
) -> list[tuple[int, int, int]] | None:
    """The DP over positions ``pos`` (first 0, last N): [(start, end, replicas)] or None."""
    n, big, m = work.units, devices, microbatches
    pre = (_prefix(work.forward_ms, n) + _prefix(work.backward_ms, n))[pos]
    par = _prefix(work.param_bytes, n)[pos]
    act = _prefix(work.activation_bytes, n)[pos]
    inb = np.asarray(work.cut_forward_bytes or (0,) * (n + 1), dtype=np.float64)[pos]
    bnd = {r: _boundary(work, r, link)[pos] for r in choices}
    held = np.array([inflight(schedule, m, big, used) for used in range(big + 1)], dtype=np.float64)
    p = len(pos)
    best = np.full((p, big + 1), np.inf)
    best[0, 0] = 0.0
    prev_i = np.zeros((p, big + 1), dtype=np.int64)
    prev_r = np.zeros((p, big + 1), dtype=np.int64)
    for jj in range(1, p):
        compute = pre[jj] - pre[:jj]
        params = par[jj] - par[:jj]
        acts = inb[:jj] + act[jj] - act[:jj]
        for r in choices:
            t = compute / r + bnd[r][:jj] + bnd[r][jj] + ring_allreduce_ms(params, r, allreduce) / m
            # column c is n = r + c devices used through this stage, after best[i][n − r]
            cand = np.maximum(best[:jj, : big + 1 - r], t[:, None])
            if memory_bytes is not None:
                mem = params[:, None] * (2 + OPTIMIZER_STATE_FACTOR) + (
                    held[None, r:] * acts[:, None] / r
                )
                cand = np.where(mem <= memory_bytes, cand, np.inf)
            x = np.argmin(cand, axis=0)
            val = cand[x, np.arange(cand.shape[1])]
            row, ri, rr = best[jj, r:], prev_i[jj, r:], prev_r[jj, r:]
            better = val < row
            row[better], ri[better], rr[better] = val[better], x[better], r
    if not np.isfinite(best[p - 1, big]):
        return None
    out, jj, used = [], p - 1, big
    while jj > 0:
        i, r = int(prev_i[jj, used]), int(prev_r[jj, used])
        out.append((int(pos[i]), int(pos[jj]), r))
        jj, used = i, used - r
    return out[::-1]


def plan_replicated(
    work: Workload,
    *,
    devices: int,
    microbatches: int,
    batch_size: int,
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
    link: Link,
    allreduce: Link,
    memory_bytes: int | None = None,
    max_positions: int = 240,
) -> PerStageCandidate:
    """Stage boundaries and per-stage replica counts over exactly ``devices`` devices.

    Links and memory as in :func:`pipecut.passes.parallel.hybrid.plan_hybrid`; ``max_positions``: above
    this many allowed cuts, search only module-boundary positions (coarsening).
    """
    if devices < 1:
        raise PartitionError(f"devices must be at least 1, got {devices}")
    if microbatches < 1 or batch_size % microbatches:
        raise PartitionError(
            f"batch size {batch_size} does not split into {microbatches} microbatches; "
            f"choose a batch size that is a multiple of the microbatch count"
        )
    size = batch_size // microbatches
    choices = tuple(r for r in range(1, min(devices, size) + 1) if size % r == 0)
    bnd1 = _boundary(work, 1, link)
    compute = tuple(f + b for f, b in zip(work.forward_ms, work.backward_ms))
    inner = candidate_cuts(
        work.modules or ("",) * work.units, compute, tuple(bnd1), max_positions=max_positions
    )
    pos = np.asarray([0, *inner, work.units], dtype=np.int64)
    split = _solve(
        work, pos, choices, devices=devices, microbatches=microbatches, schedule=schedule,
        link=link, allreduce=allreduce, memory_bytes=memory_bytes,
    )
    if split is None:
        limit = "unlimited memory" if memory_bytes is None else f"{memory_bytes / 1e9:g} GB"
        raise PartitionError(
            f"no split of {work.units} units over exactly {devices} devices fits in {limit} per "
            f"device with replica counts {choices} (divisors of the microbatch size {size}, at "
            f"most {devices}) and {len(pos) - 1} stage positions; give the devices more memory, "
            f"use fewer devices, or choose a microbatch size with more divisors"
        )
    return _describe(
        work, split, choices, devices=devices, microbatches=microbatches, batch_size=batch_size,
        schedule=schedule, link=link, allreduce=allreduce, positions=len(pos) - 2,
    )


def _describe(
    work: Workload, split: list[tuple[int, int, int]], choices: tuple[int, ...], *, devices: int,
    microbatches: int, batch_size: int, schedule: ScheduleKind, link: Link, allreduce: Link,
    positions: int,
) -> PerStageCandidate:
    m = microbatches
    reps = tuple(r for _, _, r in split)
    fwd = tuple(sum(work.forward_ms[i:j]) / r for i, j, r in split)
    bwd = tuple(sum(work.backward_ms[i:j]) / r for i, j, r in split)
    times = tuple(
        stage_ms(work, i, j, r, microbatches=m, link=link, allreduce=allreduce) for i, j, r in split
    )
    reduce_ms = tuple(
        ring_allreduce_ms(sum(work.param_bytes[i:j]), r, allreduce) for i, j, r in split
    )
    cf = work.cut_forward_bytes or (0,) * (work.units + 1)
    cb = work.cut_backward_bytes or (0,) * (work.units + 1)
    pairs = [(split[s][1], min(reps[s], reps[s + 1])) for s in range(len(split) - 1)]
    f_link = [link.transfer_ms(math.ceil(cf[c] / r)) for c, r in pairs]
    b_link = [link.transfer_ms(math.ceil(cb[c] / r)) for c, r in pairs]
    ends = rank_end_ms(build(schedule, len(split), m), fwd, bwd, f_link, b_link)
    step = max(end + r for end, r in zip(ends, reduce_ms))
    single = m * work.compute_ms
    used = np.cumsum(reps)
    memory = max(
        stage_memory_bytes(work, i, j, r, inflight(schedule, m, devices, int(u)))
        for (i, j, r), u in zip(split, used)
    )
    return PerStageCandidate(
        devices=devices, microbatches=m, batch_size=batch_size, schedule=schedule,
        bounds=(*(i for i, _, _ in split), split[-1][1]), per_stage=reps,
        forward_ms=fwd, backward_ms=bwd, stage_ms=times, allreduce_ms=reduce_ms,
        bottleneck_ms=max(times), pipeline_ms=max(ends), step_ms=step,
        efficiency=single / (devices * step) if step > 0 else 1.0, single_device_ms=single,
        peak_memory_bytes=memory, replica_choices=choices, positions=positions,
    )
