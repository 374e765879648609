"""Calibrate on the running pipeline: time every stage while all ranks run together.

Profiling and :mod:`pipecut.profile.calibrate` time the model in one process, alone. Pipelined ranks
do not run alone: on a shared host they compete for cores, caches and memory bandwidth, and
every action pays the runtime's own bookkeeping. Predictions made from solo timings run 20-30 %
under the measured step. So after compiling, the ranks run a few real training steps with the
timeline on (the executor times each action's computation, not its waits), every rank reports
the median forward and backward time of each of its stages, and the node costs of every stage
are scaled to those times (:func:`pipecut.profile.calibrate.calibrate`). What the step took beyond
its simulated actions (messages waiting for busy cores, the runtime's bookkeeping) is fitted as
the link's per-message latency (:func:`fit_latency`). The plan is then partitioned again on the
result; the split may move, and the prediction is made from costs that include what running
together costs.

The model is left as it was: gradients, buffers (BatchNorm statistics) and the RNG state are
restored after the timed steps, and no optimizer runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipecut.cluster import Link
from pipecut.core.kinds import Partitioner, Recompute
from pipecut.ir import NodeCost, Plan
from pipecut.options import DataParallelOptions, PartitionOptions
from pipecut.passes.costs.stages import build_stages
from pipecut.passes.partition.chain import liveness
from pipecut.passes.partition.solve import partition_costs
from pipecut.profile.calibrate import calibrate
from pipecut.schedules.format import Action, ActionKind

__all__ = ["LiveTimes", "fit_latency", "measure_stages", "recalibrate"]


@contextlib.contextmanager
def _restored(pipe: Any) -> Iterator[None]:
    grads = {id(p): (p, None if p.grad is None else p.grad.detach().clone()) for p in pipe.parameters()}
    buffers = [(b, b.detach().clone()) for _, b in pipe.named_buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        for p, g in grads.values():
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _medians(spans: list[tuple[str, float, float]]) -> dict[int, tuple[float, float]]:
    """Per stage: median forward ms, median backward ms (B, or I + W when split)."""
    by: dict[tuple[int, ActionKind], list[float]] = {}
    for text, start, end in spans:
        a = Action.parse(text)
        by.setdefault((a.stage, a.kind), []).append((end - start) * 1e3)
    out = {}
    for stage in sorted({s for s, _ in by}):
        forward = statistics.median(by.get((stage, ActionKind.FORWARD), [0.0]))
        if (stage, ActionKind.BACKWARD) in by:
            backward = statistics.median(by[(stage, ActionKind.BACKWARD)])
        else:
            backward = sum(statistics.median(by.get((stage, k), [0.0])) for k in (ActionKind.INPUT, ActionKind.WEIGHT))
        out[stage] = (forward, backward)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class LiveTimes:
    """What the running pipeline took: per stage (forward ms, backward ms) per microbatch, and
    the whole step (the median over the timed steps of the slowest rank's wall time)."""

    stages: tuple[tuple[float, float], ...]
    step_ms: float


MIN_TIMED_MS = 1000.0
"""Short steps are timed more often: at least this long in all (a 100 ms step jitters by more
than the 10% a prediction is held to), up to :data:`MAX_TIMED_STEPS`."""
MAX_TIMED_STEPS = 20


def measure_stages(pipe: Any, inputs: Any, target: Any, steps: int = 2) -> LiveTimes:
    """Time every stage of ``pipe.plan`` inside at least ``steps`` real pipelined steps after
    one warm-up step (more while they add up to under :data:`MIN_TIMED_MS`), and the steps
    themselves. Every rank of the world calls it (all replicas run the same number of steps);
    the ranks of one pipeline get the same result."""
    spans: list[tuple[str, float, float]] = []
    walls: list[float] = []
    with _restored(pipe):
        i = 0
        while True:
            dist.barrier(group=pipe.group)  # the ranks start the step together, as they train
            start = time.perf_counter()
            pipe.step(inputs, target, record=True)
            if i:
                walls.append((time.perf_counter() - start) * 1e3)
                spans += [(e.action, e.start, e.end) for e in pipe.events]
            i += 1
            more = len(walls) < steps or (sum(walls) < MIN_TIMED_MS and len(walls) < MAX_TIMED_STEPS)
            decided = [more]
            # Every rank of the world stops together, on rank 0's count: replicas of a
            # data-parallel mesh average each step's loss, so they must run as many steps.
            dist.broadcast_object_list(decided, src=0)
            if not decided[0]:
                break
    gathered: list[Any] = [None] * len(pipe.ranks)
    dist.all_gather_object(gathered, (_medians(spans), walls), group=pipe.group)
    merged: dict[int, tuple[float, float]] = {}
    for part, _ in gathered:
        merged.update(part)
    step_ms = statistics.median(max(w) for w in zip(*(w for _, w in gathered)))
    return LiveTimes(stages=tuple(merged[s] for s in range(pipe.plan.num_stages)), step_ms=step_ms)


def _split_facts(plan: Plan, nodes: Sequence[NodeCost], link: Link, data_parallel: DataParallelOptions | None) -> Any:
    """Stage facts and prediction of ``plan``'s own split on ``nodes`` and ``link``."""
    live = liveness(nodes)
    bounds = [live.index[s.nodes[0]] for s in plan.stages] + [len(live.units)]
    return build_stages(
        nodes, live, bounds, devices=plan.devices, link=link, schedule=plan.schedule,
        microbatches=plan.microbatches, recompute=[s.recompute for s in plan.stages],
        recomputed=[s.recomputed for s in plan.stages],
        stages_per_rank=plan.stages_per_rank, data_parallel=data_parallel,
    )


def fit_latency(
    plan: Plan, nodes: Sequence[NodeCost], step_ms: float, data_parallel: DataParallelOptions | None = None
) -> Link:
    """``plan.link`` with the per-message latency that makes ``plan``'s split, simulated on
    ``nodes``, take the measured ``step_ms`` (zero if even that is too slow; unchanged if no
    latency is enough). The link probe times messages between idle ranks; in a running
    pipeline a message also waits for a core busy computing, and the runtime pays its
    bookkeeping per message. Both show up as the step being longer than its simulated actions;
    the fitted latency carries them to every split the planner weighs, in proportion to the
    tensors each cut sends. Fitted again on a later measurement, it may go down as well as up."""
    def simulated(latency: float) -> float:
        link = dataclasses.replace(plan.link, latency_ms=latency)
        return float(_split_facts(plan, nodes, link, data_parallel).predicted.step_ms)

    low, high = 0.0, plan.link.latency_ms + step_ms
    if simulated(high) < step_ms:  # not a matter of messages
        return plan.link
    if simulated(low) >= step_ms:
        return dataclasses.replace(plan.link, latency_ms=0.0, measured=True)
    for _ in range(30):  # bisection to well under a microsecond
        mid = (low + high) / 2
        low, high = (mid, high) if simulated(mid) < step_ms else (low, mid)
    return dataclasses.replace(plan.link, latency_ms=high, measured=True)


def recalibrate(
    plan: Plan, times: LiveTimes | Sequence[tuple[float, float]], data_parallel: DataParallelOptions | None = None,
    keep_split: bool = False,
    moved: bool = False,
) -> Plan:
    """``plan`` with node costs scaled to the measured stage times (and, given the measured
    step, the link's latency fitted to it: :func:`fit_latency`), partitioned again (a split
    the user gave is kept, and so is any split with ``keep_split`` or ``moved``: a split that
    calibration moved to, timed on its own build, as its note says); predictions come from the
    scaled costs."""

    stage_times = times.stages if isinstance(times, LiveTimes) else times
    nodes = calibrate(plan.nodes, plan, list(stage_times))
    link = fit_latency(plan, nodes, times.step_ms, data_parallel) if isinstance(times, LiveTimes) else plan.link
    note = "node costs calibrated on the running pipeline"
    if link != plan.link:
        note += f" (message latency fitted to the measured step: {link.latency_ms:.3f} ms)"
    if moved:
        note = "the moved split measured again on the running pipeline" + note.removeprefix("node costs calibrated on the running pipeline")
    if (keep_split or moved or plan.solver.method is Partitioner.GIVEN
            or any(s.recompute is not Recompute.NONE for s in plan.stages)):
        facts = _split_facts(plan, nodes, link, data_parallel)
        predicted = dataclasses.replace(facts.predicted, optimum_step_ms=plan.predicted.optimum_step_ms)
        again = dataclasses.replace(plan, nodes=nodes, stages=facts.stages, edges=facts.edges,
                                    tied=facts.tied, predicted=predicted, link=link)
    else:
        again = partition_costs(
            nodes, devices=plan.devices[: plan.num_ranks], microbatches=plan.microbatches,
            batch_size=plan.batch_size, schedule=plan.schedule, link=link,
            fingerprint=plan.fingerprint, capture=plan.capture, inputs=plan.inputs,
            partition=PartitionOptions(partitioner=plan.solver.method), stages_per_rank=plan.stages_per_rank,
            data_parallel=data_parallel,
        )
        again = dataclasses.replace(again, candidates=plan.candidates, accepts=plan.accepts, profiled_on=plan.profiled_on,
                                    chunked=plan.chunked, options=plan.options)
    return dataclasses.replace(again, solver=dataclasses.replace(again.solver, detail=plan.solver.detail)).noted(note)
