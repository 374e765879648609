"""``pipecut.compile``: every rank captures, rank 0 plans, all ranks run the same plan."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecut.batching import batch_size, split_microbatches
from pipecut.capture import Inputs, capture, fingerprint
from pipecut.errors import InputError, PipelineRuntimeError, PlanError
from pipecut.passes.split import split_stage
from pipecut.plan import CaptureMethod, Link, Plan, ScheduleKind
from pipecut.planner import DEFAULT_LINK, Devices, as_devices
from pipecut.planner import plan as make_plan
from pipecut.profile import LossFn
from pipecut.runtime.launch import ensure_process_group, local_device
from pipecut.runtime.pipeline import Pipeline
from pipecut.runtime.schedule import build, validate
from pipecut.runtime.stage import StageWorker


def _pp_group(devices: Any) -> tuple[Any, Devices]:
    """(process group, device description) from an int, a list, or a DeviceMesh with "pp"."""
    names = getattr(devices, "mesh_dim_names", None)
    if names is not None:
        if "pp" not in names:
            raise InputError(f"the DeviceMesh needs a 'pp' dimension, it has {names}")
        group = devices.get_group("pp")
        return group, dist.get_world_size(group)
    return None, devices


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
) -> Pipeline:
    """Build this rank's stage of ``model`` pipelined over the ranks of the process group.

    Run the same call on every rank (under torchrun). ``plan`` replays a saved plan (a
    :class:`Plan` or a JSON path) without profiling; otherwise rank 0 plans and broadcasts.
    """
    wait = datetime.timedelta(seconds=timeout)
    ensure_process_group(wait)
    group, devices = _pp_group(devices)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    specs = as_devices(devices)
    if len(specs) != world:
        raise InputError(
            f"{len(specs)} devices (stages) asked for, but the pipeline process group has "
            f"{world} ranks; launch with --nproc_per_node={len(specs)} or pass devices={world}"
        )
    if not isinstance(example_inputs, (tuple, list, Mapping)):
        raise InputError(
            f"example_inputs must be a tuple of positional tensors or a dict of keyword tensors, "
            f"got {type(example_inputs).__name__}; wrap a single tensor as (x,)"
        )
    size = batch_size(list(example_inputs.values()) if isinstance(example_inputs, Mapping) else example_inputs)
    first = split_microbatches(example_inputs, microbatches, size)[0]
    captured = capture(model, first, method=capture_method, leaf_modules=leaf_modules)
    expected = fingerprint(captured.gm)

    if plan is not None:
        chosen = _load_plan(plan, expected)
    else:
        payload: list[Any] = [None]
        error: BaseException | None = None
        if rank == 0:
            try:
                made = make_plan(
                    model, example_inputs, specs, loss_fn=loss_fn, target=target,
                    microbatches=microbatches, schedule=schedule, link=link, captured=captured,
                )
                payload = [("ok", made.to_json())]
            except Exception as e:  # every rank must learn of it, or they wait forever
                error = e
                payload = [("error", f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(payload, src=ranks[0], group=group)
        status, text = payload[0]
        if error is not None:
            raise error
        if status != "ok":
            raise PipelineRuntimeError(f"rank {rank}: rank 0 failed to plan: {text}")
        chosen = _load_plan(text, expected)
    if chosen.num_stages != world:
        raise PlanError(
            f"the plan has {chosen.num_stages} stages but the process group has {world} ranks; "
            f"launch with --nproc_per_node={chosen.num_stages} or re-plan for {world} devices"
        )
    if chosen.microbatches != microbatches and plan is None:
        raise PlanError(f"plan has {chosen.microbatches} microbatches, asked for {microbatches}")

    device = local_device()
    program = split_stage(captured.gm, chosen, rank)
    program.module.to(device)
    sched = build(chosen.schedule, chosen.num_stages, chosen.microbatches)
    validate(sched, chosen.microbatches)
    worker = StageWorker(
        program, chosen, rank=rank, ranks=ranks, group=group, device=device, loss_fn=loss_fn,
        unflatten_output=captured.unflatten_output, timeout=wait,
    )
    tied_groups = []
    made_groups: dict[tuple[int, ...], Any] = {}
    for tied in chosen.tied:  # every rank creates every group, in plan order
        if tied.stages not in made_groups:
            made_groups[tied.stages] = dist.new_group([ranks[s] for s in tied.stages], timeout=wait)
        if rank in tied.stages:
            tied_groups.append((tied.fqn, made_groups[tied.stages]))
    return Pipeline(
        plan=chosen, captured=captured, worker=worker, schedule=sched, ranks=ranks, group=group,
        tied_groups=tied_groups,
    )
