"""Calibrate on the running pipeline: time every stage while all ranks run together.

Profiling and :mod:`pipecut.profile.calibrate` time the model in one process, alone. Pipelined ranks
do not run alone: on a shared host they compete for cores, caches and memory bandwidth, and
every action pays the runtime's own bookkeeping. Predictions made from solo timings run 20-30 %
under the measured step. So after compiling, the ranks run a few real training steps with the
timeline on (the executor times each action's computation, not its waits), every rank reports
the median forward and backward time of each of its stages, and the node costs of every stage
are scaled to those times (:func:`pipecut.profile.calibrate.calibrate`). The plan is then partitioned
again on the result; the split may move, and the prediction is made from costs that include
what running together costs.

The model is left as it was: gradients, buffers (BatchNorm statistics) and the RNG state are
restored after the timed steps, and no optimizer runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from pipecut.core.schedule import Action, ActionKind
from pipecut.parallel import DataParallel
from pipecut.partition import partition_costs
from pipecut.passes.chain import liveness
from pipecut.passes.stages import build_stages
from pipecut.plan import Partitioner, Plan, Recompute
from pipecut.profile.calibrate import calibrate

__all__ = ["measure_stages", "recalibrate"]


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


def measure_stages(pipe: Any, inputs: Any, target: Any, steps: int = 2) -> list[tuple[float, float]]:
    """(forward ms, backward ms) per microbatch of every stage of ``pipe.plan``, timed inside
    ``steps`` real pipelined steps after one warm-up step. Every rank of the pipeline calls it
    and gets the same list."""
    spans: list[tuple[str, float, float]] = []
    with _restored(pipe):
        for i in range(steps + 1):
            pipe.step(inputs, target, record=True)
            if i:
                spans += [(e.action, e.start, e.end) for e in pipe.events]
    mine = _medians(spans)
    gathered: list[Any] = [None] * len(pipe.ranks)
    dist.all_gather_object(gathered, mine, group=pipe.group)
    merged: dict[int, tuple[float, float]] = {}
    for part in gathered:
        merged.update(part)
    return [merged[s] for s in range(pipe.plan.num_stages)]


def recalibrate(plan: Plan, times: list[tuple[float, float]], data_parallel: DataParallel | None = None) -> Plan:
    """``plan`` with node costs scaled to the measured stage times, partitioned again (a split
    the user gave is kept); predictions come from the scaled costs."""

    nodes = calibrate(plan.nodes, plan, times)
    note = "node costs calibrated on the running pipeline"
    if plan.solver.method is Partitioner.GIVEN or any(s.recompute is not Recompute.NONE for s in plan.stages):
        live = liveness(nodes)
        bounds = [live.index[s.nodes[0]] for s in plan.stages] + [len(live.units)]
        facts = build_stages(
            nodes, live, bounds, devices=plan.devices, link=plan.link, schedule=plan.schedule,
            microbatches=plan.microbatches, recompute=[s.recompute for s in plan.stages],
            recomputed=[s.recomputed for s in plan.stages],
            stages_per_rank=plan.stages_per_rank, data_parallel=data_parallel,
        )
        predicted = dataclasses.replace(facts.predicted, optimum_step_ms=plan.predicted.optimum_step_ms)
        again = dataclasses.replace(plan, nodes=nodes, stages=facts.stages, edges=facts.edges,
                                    tied=facts.tied, predicted=predicted)
    else:
        again = partition_costs(
            nodes, devices=plan.devices[: plan.num_ranks], microbatches=plan.microbatches,
            batch_size=plan.batch_size, schedule=plan.schedule, link=plan.link,
            fingerprint=plan.fingerprint, capture=plan.capture, inputs=plan.inputs,
            partitioner=plan.solver.method, stages_per_rank=plan.stages_per_rank,
            data_parallel=data_parallel,
        )
        again = dataclasses.replace(again, candidates=plan.candidates, accepts=plan.accepts, profiled_on=plan.profiled_on)
    detail = f"{plan.solver.detail}; {note}" if plan.solver.detail else note  # keeps earlier notes
    return dataclasses.replace(again, solver=dataclasses.replace(again.solver, detail=detail))
