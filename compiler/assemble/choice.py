"""Which plan this build runs, on which graph: compile's capture → plan → broadcast → check steps.

A plan given is replayed; otherwise global rank 0 plans and every rank receives its plan (with
"auto" microbatches or schedule, before capture: the graph is captured at the chosen count).
Every rank captures the model itself and checks the plan against its graph, its process group
and what the runtime can run, before any stage is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from pipecut.assemble.context import Place
from pipecut.assemble.layout import plan_from_rank0
from pipecut.capture import as_planned, capture_as, fingerprint
from pipecut.capture.agree import capture_for_plan
from pipecut.core.batching import first_microbatch
from pipecut.core.program import Captured, Inputs
from pipecut.errors import PlanError
from pipecut.ir import Plan
from pipecut.options import AUTO, DataParallelOptions, RuntimeOptions, ScheduleOptions
from pipecut.passes.costs.stages import plan_schedule
from pipecut.planning.asked import Resolved, mesh_sizes
from pipecut.planning.planner import plan_asked
from pipecut.planning.request import Request, warn_if_sequential
from pipecut.runtime.comm.nccl import check_nccl
from pipecut.runtime.comm.p2p import wiring
from pipecut.runtime.grads.data_parallel import check_supported
from pipecut.schedules.format import Schedule, validate

__all__ = ["Chosen", "capture_and_broadcast_plan", "check_fingerprint", "check_tensor_group", "runnable_schedule"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Chosen:
    """The plan this build runs, the graph its stages name, and the first microbatch."""

    plan: Plan
    captured: Captured
    first: Inputs


def capture_and_broadcast_plan(request: Request, place: Place, settings: Resolved) -> Chosen:
    """Capture the model on every rank; replay the given plan or take rank 0's, checked."""
    chosen = _on_rank0(request, place, settings, None) if settings.auto else request.given
    if chosen is not None and request.given is not None and dist.get_rank() == 0:
        warn_if_sequential(request.given)
    if chosen is not None:
        microbatches = chosen.microbatches
    else:  # not "auto": the planner chose nothing yet
        assert isinstance(settings.microbatches, int)
        microbatches = settings.microbatches
    _, first = first_microbatch(request.example_inputs, microbatches)
    options, method = request.options.capture, settings.capture_method
    if chosen is None:  # every rank captures, rank 0 plans on its graph
        captured = capture_as(request.model, first, options, method=method)
        chosen = _on_rank0(request, place, settings, captured)
        captured = capture_for_plan(request.model, first, chosen, options, method=method, got=captured)
    else:  # the graph the plan names (a time limit may have run out on rank 0 only)
        captured = capture_for_plan(request.model, first, chosen, options, method=method)
    check_fingerprint(chosen, fingerprint(captured.gm))
    if chosen.num_ranks != place.world:
        raise PlanError(
            f"the plan is for {chosen.num_ranks} ranks ({chosen.num_stages} stages) but the "
            f"pipeline process group has {place.world} ranks; launch with "
            f"--nproc_per_node={chosen.num_ranks} or re-plan for {place.world} devices"
        )
    if chosen.microbatches != microbatches and request.given is None:
        raise PlanError(f"plan has {chosen.microbatches} microbatches, asked for {microbatches}")
    return Chosen(plan=chosen, captured=as_planned(captured, chosen.chunked), first=first)


def _on_rank0(request: Request, place: Place, settings: Resolved, captured: Captured | None) -> Plan:
    """Global rank 0 plans the request on this pipeline's devices, with its link, at the
    settings' scheduling; every rank of every replica gets the same plan, which records what
    ``compile`` was asked (its runtime options included)."""
    measure = dataclasses.replace(  # by default measured where rank 0's stage will run, not where the model was left
        request.options.measure, link=place.link, device=request.options.measure.device or str(place.device))
    assert settings.stages_per_rank != AUTO  # compile resolves a count (only a cluster plan weighs V)
    planning = dataclasses.replace(request.with_options(
        microbatches=settings.microbatches, schedule=settings.schedule, measure=measure,
        scheduling=ScheduleOptions(stages_per_rank=settings.stages_per_rank),
        data_parallel=place.replication or DataParallelOptions(), runtime=RuntimeOptions(),
    ), specs=place.specs)
    return plan_from_rank0(lambda: dataclasses.replace(plan_asked(planning, captured), options=request.options))


def check_tensor_group(plan: Plan, devices: Any) -> None:
    """PlanError for a cluster plan whose stages are split over tensor-parallel groups of T GPUs
    (``plan(..., cluster=...)`` with ``placement.tensor_parallel`` = T > 1) given devices
    without a "tp" dimension of T: ``compile`` replays it over a DeviceMesh with dimensions
    ("dp", "pp", "tp") of (D, K, T) (:mod:`pipecut.assemble.tensor` splits each stage as DTensors),
    and its stages were priced at one GPU's share of that split."""
    t = plan.placement.tensor_parallel if plan.placement is not None else 1
    sizes = mesh_sizes(devices)
    given = sizes.get("tp", 1)
    if t > 1 and given != t:
        place = plan.placement
        assert place is not None
        asked = plan.options is None or plan.options.tensor_parallel.size is not None
        chosen = "" if asked else f", chosen by tensor_parallel={AUTO!r}, plan()'s default"
        has = f"a 'tp' dimension of {given}" if "tp" in sizes else "no 'tp' dimension"
        raise PlanError(
            f"this cluster plan splits its stages over tensor-parallel groups of {t} GPUs "
            f"(placement.tensor_parallel={t}{chosen}), but the devices have {has}; compile it over "
            f"init_device_mesh(..., ({place.replicas}, {place.stages}, {t}), mesh_dim_names=('dp', 'pp', 'tp')), "
            f"or re-plan with tensor_parallel=1 (CLI --tensor-parallel 1)"
        )


def check_fingerprint(loaded: Plan, expected: str) -> None:
    if loaded.fingerprint != expected:
        raise PlanError(
            f"the plan was made for another model (plan fingerprint {loaded.fingerprint}, this "
            f"model's graph {expected}); re-plan with pipecut.plan(...) for this model"
        )


def runnable_schedule(plan: Plan, place: Place) -> Schedule:
    """The plan's per-rank schedule, refused before anything runs where the runtime cannot run
    it: an order that would hang NCCL, a data-parallel engine this torch cannot drive."""
    sched = plan_schedule(plan)
    validate(sched, plan.microbatches, plan.schedule.placement)
    check_nccl(sched, wiring(plan))
    if place.replication is not None:
        check_supported(plan, place.replication.resolved_kind, place.tensor_parallel, engine_origin=place.engine_origin)
    return sched
