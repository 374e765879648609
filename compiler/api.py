"""``pipecut.compile``: every rank captures, rank 0 plans, all ranks run the same plan."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecut.batching import first_microbatch
from pipecut.capture import Inputs, capture, fingerprint
from pipecut.errors import InputError, PipelineRuntimeError, PlanError
from pipecut.passes.split import split_stage
from pipecut.passes.stages import plan_schedule
from pipecut.plan import CaptureMethod, Link, Plan, Recompute, ScheduleKind
from pipecut.planner import DEFAULT_LINK, Devices, as_devices
from pipecut.planner import plan as make_plan
from pipecut.profile import LossFn
from pipecut.runtime.launch import ensure_process_group, local_device, ready_for_p2p
from pipecut.runtime.nccl import check_nccl
from pipecut.runtime.p2p import wiring
from pipecut.runtime.pipeline import Pipeline
from pipecut.runtime.schedule import validate
from pipecut.runtime.stage import StageWorker


@dataclass(frozen=True)
class _Layout:
    """Where this rank sits: its pipeline group and, with data parallelism, its replica group."""

    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    replicas: tuple[tuple[int, ...], ...]
    """Global ranks of every pipeline replica, stage-rank order; this rank's replica included."""
    devices: Any


def _layout(devices: Any) -> _Layout:
    """From an int, a list of devices, or a DeviceMesh with a "pp" (and maybe "dp") dimension."""
    names = getattr(devices, "mesh_dim_names", None)
    if names is None:
        world = dist.get_world_size()
        return _Layout(None, None, (tuple(range(world)),), devices)
    if "pp" not in names or not set(names) <= {"dp", "pp"}:
        raise InputError(f"the DeviceMesh needs dimensions ('dp', 'pp') or ('pp',), it has {names}")
    pp = devices.get_group("pp")
    dp = devices.get_group("dp") if "dp" in names else None
    mesh = devices.mesh if names.index("pp") == len(names) - 1 else devices.mesh.transpose(0, 1)
    replicas = tuple(tuple(int(r) for r in row) for row in mesh.reshape(-1, mesh.shape[-1]).tolist())
    return _Layout(pp, dp, replicas, dist.get_world_size(pp))


def _load_plan(plan: Plan | str | Path, expected: str) -> Plan:
    loaded = plan if isinstance(plan, Plan) else Plan.from_json(plan)
    if loaded.fingerprint != expected:
        raise PlanError(
            f"the plan was made for another model (plan fingerprint {loaded.fingerprint}, this "
            f"model's graph {expected}); re-plan with pipecut.plan(...) for this model"
        )
    return loaded


def compile(
    model: torch.nn.Module,
    devices: Devices | Any,
    *,
    example_inputs: Inputs,
    loss_fn: LossFn,
    target: Any = None,
    microbatches: int = 1,
    schedule: str | ScheduleKind = ScheduleKind.GPIPE,
    plan: Plan | str | Path | None = None,
    link: Link = DEFAULT_LINK,
    timeout: float = 300.0,
    capture_method: CaptureMethod | None = None,
    leaf_modules: tuple[type, ...] = (),
    stages_per_rank: int = 1,
) -> Pipeline:
    """Build this rank's stage of ``model`` pipelined over the ranks of the process group.

    Run the same call on every rank (under torchrun). ``devices``: K (one stage per rank of the
    default group), a list of K devices, or a DeviceMesh with dimensions ("dp", "pp"), where
    each of the D replicas of the pipeline trains on its own share of the batch and gradients
    are averaged over replicas. ``plan`` replays a saved plan (a :class:`Plan` or a JSON path)
    without profiling; otherwise global rank 0 plans and broadcasts. ``stages_per_rank`` > 1
    with ``schedule="interleaved-1f1b"`` gives each rank several virtual stages.
    """
    wait = datetime.timedelta(seconds=timeout)
    device = local_device()  # before any collective (NCCL)
    ensure_process_group(wait, device)
    layout = _layout(devices)
    group = layout.pp_group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    specs = as_devices(layout.devices)
    if len(specs) != world:
        raise InputError(
            f"{len(specs)} devices (stages) asked for, but the pipeline process group has "
            f"{world} ranks; launch with --nproc_per_node={len(specs)} or pass devices={world}"
        )
    _, first = first_microbatch(example_inputs, microbatches)
    captured = capture(model, first, method=capture_method, leaf_modules=leaf_modules)
    expected = fingerprint(captured.gm)

    if plan is not None:
        chosen = _load_plan(plan, expected)
    else:  # global rank 0 plans; every rank of every replica gets the same plan
        payload: list[Any] = [None]
        error: BaseException | None = None
        if dist.get_rank() == 0:
            try:
                made = make_plan(
                    model, example_inputs, specs, loss_fn=loss_fn, target=target,
                    microbatches=microbatches, schedule=schedule, link=link, captured=captured,
                    stages_per_rank=stages_per_rank,
                )
                payload = [("ok", made.to_json())]
            except Exception as e:  # every rank must learn of it, or they wait forever
                error = e
                payload = [("error", f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(payload, src=0)
        status, text = payload[0]
        if error is not None:
            raise error
        if status != "ok":
            raise PipelineRuntimeError(f"rank {dist.get_rank()}: rank 0 failed to plan: {text}")
        chosen = _load_plan(text, expected)
    if chosen.num_ranks != world:
        raise PlanError(
            f"the plan is for {chosen.num_ranks} ranks ({chosen.num_stages} stages) but the "
            f"pipeline process group has {world} ranks; launch with "
            f"--nproc_per_node={chosen.num_ranks} or re-plan for {world} devices"
        )
    if chosen.microbatches != microbatches and plan is None:
        raise PlanError(f"plan has {chosen.microbatches} microbatches, asked for {microbatches}")

    if chosen.schedule is ScheduleKind.ZERO_BUBBLE and any(s.recompute is not Recompute.NONE for s in chosen.stages):
        raise PlanError(
            "the zero-bubble schedule cannot yet run stages that recompute; use schedule='1f1b' "
            "or plan without recompute"
        )
    sched = plan_schedule(chosen)
    validate(sched, chosen.microbatches)
    check_nccl(sched, wiring(chosen))  # refuse an order that would hang, before anything runs
    workers = {}
    for stage in range(rank, chosen.num_stages, world):
        program = split_stage(captured.gm, chosen, stage)
        program.module.to(device)
        workers[stage] = StageWorker(
            program, chosen, rank=rank, ranks=ranks, group=group, device=device, loss_fn=loss_fn,
            unflatten_output=captured.unflatten_output, timeout=wait,
        )
    ready_for_p2p(group, device)
    return Pipeline(
        plan=chosen, captured=captured, workers=workers, schedule=sched, rank=rank, ranks=ranks,
        group=group, tied_groups=_tied_groups(chosen, layout, rank, wait), dp_group=layout.dp_group,
    )


def _tied_groups(plan: Plan, layout: _Layout, rank: int, wait: datetime.timedelta) -> list[tuple[str, Any]]:
    """Process groups over the ranks that hold each tied parameter. Every rank creates every
    group (new_group is collective), in plan order, replica by replica."""
    k = plan.num_ranks
    mine = []
    made: dict[tuple[int, ...], Any] = {}
    for replica in layout.replicas:
        for tied in plan.tied:
            holders = tuple(sorted({s % k for s in tied.stages}))
            if len(holders) < 2:
                continue  # the stages holding it share one rank, and so one parameter object
            global_ranks = tuple(replica[h] for h in holders)
            if global_ranks not in made:
                made[global_ranks] = dist.new_group(list(global_ranks), timeout=wait)
            if dist.get_rank() in global_ranks:
                mine.append((tied.fqn, made[global_ranks]))
    return mine
