"""``pipecut.compile``: every rank captures, rank 0 plans, all ranks run the same plan."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import gc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecut.capture import as_planned, capture, fingerprint
from pipecut.capture.modes import Modes, derive_other_mode
from pipecut.core.batching import first_microbatch
from pipecut.core.meta import has_meta
from pipecut.core.program import Captured, Inputs, StageProgram
from pipecut.core.schedule import validate
from pipecut.errors import CaptureError, InputError, PipecutError, PlanError
from pipecut.layout import Layout, auto_layout, layout_of, plan_from_rank0, replication_of
from pipecut.parallel import DataParallelKind
from pipecut.passes.costs.stages import plan_schedule, predicted_timeline
from pipecut.passes.rewrite.split import split_stage
from pipecut.plan import CaptureMethod, Link, Plan, Recompute, ScheduleKind
from pipecut.planning.autoplan import AUTO
from pipecut.planning.partition import Devices, as_devices
from pipecut.planning.planner import default_choices, warn_if_sequential
from pipecut.planning.planner import plan as make_plan
from pipecut.profile.compiled import AUTO as COMPILE_AUTO
from pipecut.profile.compiled import measure_and_choose, parse_compile_stages, with_note
from pipecut.profile.live import measure_stages, recalibrate
from pipecut.profile.nodes import LossFn
from pipecut.replay import settings
from pipecut.resolve import WireSpecs, schedules
from pipecut.runtime.allocator import return_large_frees
from pipecut.runtime.capacity import gathered_free_bytes, with_capacities
from pipecut.runtime.compiled import check_compilable
from pipecut.runtime.data_parallel import check_supported, replicate
from pipecut.runtime.grads import LossReduction, parse_loss_reduction
from pipecut.runtime.launch import ensure_process_group, local_device, ready_for_p2p
from pipecut.runtime.linkprobe import measure_link
from pipecut.runtime.materialize import Init, check_unexpected, materialize_stage, raise_together
from pipecut.runtime.nccl import check_nccl
from pipecut.runtime.p2p import wiring
from pipecut.runtime.pipeline import Pipeline
from pipecut.runtime.stage import StageWorker
from pipecut.runtime.sync import stage_state, sync_from_rank0
from pipecut.runtime.weights import Weights, open_weights

__all__ = ["compile"]


def _check_fingerprint(loaded: Plan, expected: str) -> None:
    if loaded.fingerprint != expected:
        raise PlanError(
            f"the plan was made for another model (plan fingerprint {loaded.fingerprint}, this "
            f"model's graph {expected}); re-plan with pipecut.plan(...) for this model"
        )


def compile(
    model: torch.nn.Module,
    devices: Devices | Any = None,
    *,
    example_inputs: Inputs,
    loss_fn: LossFn,
    target: Any = None,
    microbatches: int | str | None = None,
    schedule: str | ScheduleKind | None = None,
    plan: Plan | str | Path | None = None,
    link: Link | None = None,
    timeout: float = 300.0,
    capture_method: CaptureMethod | None = None,
    leaf_modules: tuple[type, ...] = (),
    stages_per_rank: int | None = None,
    calibration_steps: int = 2,
    loss_reduction: str | LossReduction = LossReduction.MEAN,
    data_parallel: str | DataParallelKind | None = None,
    weights: Weights | None = None,
    init: Init | None = None,
    seed: int = 0,
    lean_host_memory: bool = False,
    chunk_heavy: bool = True,
    compile_stages: bool | str = False,
    _remeasure: bool = False,
) -> Pipeline:
    """Build this rank's stage of ``model`` pipelined over the ranks of the process group.

    Run the same call on every rank (under torchrun). ``devices``: K (one stage per rank of the
    default group), a list of K devices, or a DeviceMesh with dimensions ("dp", "pp"), where
    each of the D replicas of the pipeline trains on its own share of the batch and gradients
    are averaged over replicas. ``plan`` replays a saved plan (a :class:`Plan` or a JSON path)
    without profiling; otherwise global rank 0 plans and broadcasts. ``stages_per_rank`` > 1
    with ``schedule="interleaved-1f1b"`` gives each rank several virtual stages.
    ``calibration_steps``: when planning, run this many timed steps of the compiled pipeline
    (after one warm-up; the model is left as it was), scale the plan's costs to what each stage
    took while all ranks ran together, and plan again (see :mod:`pipecut.profile.live`);
    0 skips it.
    ``loss_reduction``: "mean" (``loss_fn`` returns a mean; the step's loss is the mean over
    microbatches) or "sum" (``loss_fn`` returns a sum; ``step(..., normalizer=n)`` divides the
    sum over microbatches by n, e.g. the number of valid tokens in the whole batch).
    ``data_parallel``: with a "dp" dimension, ``"ddp"`` (the default) wraps each stage module in
    DistributedDataParallel over its replicas, ``"fsdp"`` shards it with FSDP2 ``fully_shard``
    (parameters, gradients and optimizer state divided over the replicas).
    ``data_parallel="auto"`` (``devices`` None or the world size N): global rank 0 profiles the
    whole batch of ``example_inputs`` and chooses D replicas of a K-stage pipeline, N = D × K,
    by predicted step (see ``pipecut.plan(..., data_parallel="auto")``); every rank then builds
    the ("dp", "pp") DeviceMesh of that shape (replica r on global ranks r·K … r·K + K − 1)
    and compiles its stage with DDP over the replicas, replaying that plan (so no live
    calibration). ``pipe.plan.data_parallel.replicas`` is D; each replica then steps on its own
    share of every global batch: the ``dist.get_rank(pipe.dp_group)``-th of D equal slices
    (the whole batch when D = 1). A given ``plan=`` with ``data_parallel`` recorded replays
    its layout.

    ``devices``, ``microbatches``, ``schedule``, ``stages_per_rank``, ``link`` and
    ``capture_method`` left at None mean the plan's (with ``plan=``) or the defaults (one stage
    per rank of the default group, microbatches chosen by the planner ("auto") and the schedule
    with them (GPipe beside a given microbatch count), 1, the link measured between
    neighbours, symbolic_trace then torch.export; with ``data_parallel="auto"``, 1 microbatch
    and GPipe); one microbatch on several ranks logs a
    warning that the stages run one after another; with ``plan=``, a value that contradicts the plan is a PlanError. Every
    rank's stage weights are set to global rank 0's, as DistributedDataParallel does.

    ``model`` may be on the meta device (``with torch.device("meta"):``): each rank then
    allocates only its stage's tensors and fills them from ``weights`` (a ``.safetensors``
    file, a ``save_pretrained`` directory, a pipecut checkpoint directory or a state dict; see
    :mod:`pipecut.runtime.weights`), or, without weights, initialises them with
    ``init(fqn, module)`` or each module's ``reset_parameters()`` under a seed derived from
    ``seed`` and the module name (so the values do not depend on K). ``model`` itself is left
    as it is. A real model given ``weights`` has its stage's tensors overwritten from them.

    ``lean_host_memory``: on CPU ranks, fix glibc's mmap threshold so that every freed block
    of 1 MiB or more goes back to the system at once (see :mod:`pipecut.runtime.allocator`):
    peak RSS then follows the live tensors the plan predicts (0.67–0.70× the model's bytes per
    rank at K = 4 on the memory benchmark, against 0.74–1.07× with glibc's default), at the
    price of mapping fresh pages for every weight-sized gradient (steps 1.5× slower there).

    ``compile_stages``: run each stage module through ``torch.compile`` (inductor), whole, in
    place (see :mod:`pipecut.runtime.compiled`); each rank compiles its stages at their first
    step, and ``pipe.compile_stats`` says how many graphs and seconds that took. ``"auto"``:
    the calibration steps time the stages eager and compiled, and the compiled ones are kept
    if their saving pays for the compile time (see :mod:`pipecut.profile.compiled`).

    ``chunk_heavy``: when planning, let a node heavier than a stage's share (a large-vocabulary
    LM head) be computed in row pieces on several stages (see ``pipecut.plan``); a plan given
    or planned with ``chunked`` nodes is run on the graph rewritten the same way.
    """
    reduction = parse_loss_reduction(loss_reduction)
    compile_stages = parse_compile_stages(compile_stages, calibrates=(plan is None or _remeasure) and calibration_steps > 0)
    wait = datetime.timedelta(seconds=timeout)
    given = None if plan is None else plan if isinstance(plan, Plan) else Plan.from_json(plan)
    if data_parallel == AUTO:
        chosen_layout, share = auto_layout(
            model, devices, given, example_inputs=example_inputs, loss_fn=loss_fn, target=target,
            microbatches=microbatches, schedule=schedule, link=link, wait=wait,
            capture_method=capture_method, leaf_modules=leaf_modules, stages_per_rank=stages_per_rank,
        )
        return compile(
            model, chosen_layout.mesh if chosen_layout.mesh is not None else chosen_layout.plan.num_ranks,
            example_inputs=share[0], loss_fn=loss_fn, target=share[1], plan=chosen_layout.plan,
            timeout=timeout, capture_method=capture_method, leaf_modules=leaf_modules,
            loss_reduction=reduction, weights=weights, init=init, seed=seed,
            data_parallel=None if chosen_layout.mesh is None else chosen_layout.kind,
            compile_stages=compile_stages,
        )
    if given is None:  # left out: the planner chooses, so the default pipelines
        microbatches, schedule = default_choices(microbatches, schedule)
    auto = AUTO in (microbatches, schedule)
    if auto and given is not None:
        raise PlanError(
            "microbatches/schedule='auto' ask the planner to choose, but plan= fixes them; drop "
            "plan= to plan again, or leave microbatches and schedule out to replay the plan"
        )
    run = settings(
        given, microbatches=microbatches if isinstance(microbatches, int) else None,
        schedule=None if schedule == AUTO else schedule, stages_per_rank=stages_per_rank,
        link=link, capture_method=capture_method, devices=devices,
    )
    asked_microbatches: int | str = microbatches if microbatches is not None else run.microbatches
    asked_schedule: str | ScheduleKind = schedule if schedule is not None else run.schedule
    microbatches, schedule, stages_per_rank = run.microbatches, run.schedule, run.stages_per_rank
    device = local_device()  # before any collective (NCCL)
    ensure_process_group(wait, device)
    if lean_host_memory and device.type == "cpu" and not return_large_frees():
        warnings.warn("lean_host_memory: the allocator was left as it is (not glibc, or "
                      "MALLOC_MMAP_THRESHOLD_ or PIPECUT_KEEP_MALLOC=1 set)", stacklevel=2)
    layout = layout_of(devices)
    replication = replication_of(layout, data_parallel)
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
    if device.type == "cuda":  # free memory as capacity; CPU ranks share the host: no limit read
        specs = with_capacities(specs, gathered_free_bytes(device, group))
    source = open_weights(weights) if weights is not None else None
    if source is not None:
        check_unexpected(source, model)
    used_link = run.link
    if given is None and link is None:  # measured between neighbours, the same on every rank
        used_link = measure_link(ranks, rank, group, device) or run.link

    def plan_on_rank0(captured: Captured | None) -> Plan:
        """Global rank 0 plans; every rank of every replica gets the same plan."""
        return plan_from_rank0(lambda: make_plan(
            model, example_inputs, specs, loss_fn=loss_fn, target=target,
            microbatches=asked_microbatches, schedule=asked_schedule, link=used_link,
            captured=captured, stages_per_rank=stages_per_rank, data_parallel=replication,
            device=device,  # measured where rank 0's stage will run, not where the model was left
            chunk_heavy=chunk_heavy,
        ))

    chosen = plan_on_rank0(None) if auto else given  # "auto": capture at the chosen microbatches
    if chosen is not None:
        microbatches, schedule = chosen.microbatches, chosen.schedule
        if given is not None and dist.get_rank() == 0:
            warn_if_sequential(given)
    _, first = first_microbatch(example_inputs, microbatches)
    captured = capture(model, first, method=run.capture_method, leaf_modules=leaf_modules)
    expected = fingerprint(captured.gm)
    if chosen is not None:
        _check_fingerprint(chosen, expected)
    else:
        chosen = plan_on_rank0(captured)
        _check_fingerprint(chosen, expected)
    captured = as_planned(captured, chosen.chunked)  # the graph the plan's stages name
    if chosen.num_ranks != world:
        raise PlanError(
            f"the plan is for {chosen.num_ranks} ranks ({chosen.num_stages} stages) but the "
            f"pipeline process group has {world} ranks; launch with "
            f"--nproc_per_node={chosen.num_ranks} or re-plan for {world} devices"
        )
    if chosen.microbatches != microbatches and plan is None:
        raise PlanError(f"plan has {chosen.microbatches} microbatches, asked for {microbatches}")

    if chosen.schedule.splits_backward and any(s.recompute is not Recompute.NONE for s in chosen.stages):
        raise PlanError(
            f"the {chosen.schedule.value} schedule cannot yet run stages that recompute; use "
            f"schedule='1f1b' or plan without recompute"
        )
    sched = plan_schedule(chosen)
    validate(sched, chosen.microbatches, chosen.schedule.placement)
    check_nccl(sched, wiring(chosen))  # refuse an order that would hang, before anything runs
    if compile_stages:  # issue 22: stages run through torch.compile (pipecut.runtime.compiled)
        check_compilable(chosen, data_parallel=replication is not None)
    if replication is not None:
        check_supported(chosen, replication.kind)
    derived = other_mode(model, first, captured, chosen, leaf_modules)  # before moving to device

    def make_worker(program: StageProgram, for_plan: Plan, unflatten: Callable[[Any], Any]) -> StageWorker:
        worker = StageWorker(
            program, for_plan, rank=rank, ranks=ranks, group=group, device=device, loss_fn=loss_fn,
            unflatten_output=unflatten, timeout=wait,
        )
        if compile_stages is True:  # issue 22 ("auto": after the calibration steps time eager)
            worker.compile()
        return worker

    if has_meta(captured.gm):  # this rank's copy (meta: no storage); only its stage becomes real
        with warnings.catch_warnings():  # torch's own pytree warns while copying export's specs
            warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated", category=FutureWarning)
            captured = dataclasses.replace(captured, gm=copy.deepcopy(captured.gm))
    workers = {}
    failure: BaseException | None = None
    for stage in chosen.stages_on(rank):
        program = split_stage(captured.gm, chosen, stage)
        try:
            materialize_stage(
                program.module, (captured.gm,), model, device=device, source=source, init=init,
                seed=seed, where=f"stage {stage} (rank {dist.get_rank()})",
            )
        except InputError as e:
            failure = failure or e
            continue
        program.module.to(device)
        workers[stage] = make_worker(program, chosen, captured.unflatten_output)
    if source is not None or has_meta(model):  # the same on every rank
        raise_together(failure)
    _sync_weights(captured, chosen, layout, workers, device, wait)
    modes = Modes(model=model, workers=workers, derived=derived, make_worker=make_worker, device=device)
    ready_for_p2p(group, device)
    pipe = Pipeline(
        plan=chosen, captured=captured, workers=workers, schedule=sched, rank=rank, ranks=ranks,
        group=group, tied_groups=_tied_groups(chosen, layout, rank, wait), dp_group=layout.dp_group,
        loss_reduction=reduction, modes=modes,
        wire=WireSpecs(captured.gm, chosen, device), schedule_for=schedules(chosen),
        predicted=predicted_timeline(chosen),
    )
    if (plan is None or _remeasure) and calibration_steps > 0:  # before any wrapping: FSDP changes the modules
        choice = None
        if compile_stages == COMPILE_AUTO:  # issue 22: eager and compiled timed, one kept
            choice, times = measure_and_choose(pipe, example_inputs, target, calibration_steps)
            compile_stages = choice.compiled
        else:
            times = measure_stages(pipe, example_inputs, target, calibration_steps)
        again: list[Any] = [None]
        if dist.get_rank() == 0:
            again = [recalibrate(chosen, times, replication, keep_split=_remeasure)]
            again = [(with_note(again[0], choice) if choice is not None else again[0]).to_json()]
        dist.broadcast_object_list(again, src=0)
        recalibrated = Plan.from_json(again[0])
        if _remeasure or recalibrated.runs_like(chosen):  # same split: keep this build, take the new costs
            pipe.plan, pipe.predicted = recalibrated, tuple(predicted_timeline(recalibrated))
        else:
            # The split moved: build again from the new plan, after this build's stage tensors
            # are gone (two builds alive at once would double every rank's peak memory), and
            # time the new split too: its prediction then comes from its own stages' times,
            # not from node costs scaled on the old ones. That split is kept.
            del pipe, workers, modes, program, captured, derived
            gc.collect()
            return compile(
                model, devices, example_inputs=example_inputs, loss_fn=loss_fn, target=target,
                microbatches=microbatches, schedule=schedule, plan=recalibrated, link=link,
                timeout=timeout, capture_method=capture_method, leaf_modules=leaf_modules,
                stages_per_rank=recalibrated.stages_per_rank, loss_reduction=reduction, data_parallel=data_parallel,
                weights=weights, init=init, seed=seed, calibration_steps=calibration_steps, _remeasure=True,
                compile_stages=compile_stages,
            )
    if replication is not None:  # after Pipeline has read the parameter names FSDP may change
        assert layout.dp_group is not None  # _replication gives None without a "dp" dimension
        replicate(workers, sched[rank], replication.kind, group=layout.dp_group, mesh=layout.dp_mesh)
    return pipe


def other_mode(
    model: torch.nn.Module, first: Inputs, captured: Captured, plan: Plan, leaf_modules: tuple[type, ...]
) -> tuple[Captured, Plan] | Exception | None:
    """The other train/eval mode's graph and plan; an error is kept, to be raised only when
    that mode is asked for (training in the compiled mode does not need it)."""
    try:
        with torch.random.fork_rng(devices=[]):  # compile draws no more random numbers than before
            return derive_other_mode(model, first, captured, plan, leaf_modules)
    except PipecutError as e:
        return e
    except Exception as e:
        mode = "eval" if model.training else "train"
        error = CaptureError(f"the model cannot run in {mode} mode in this pipeline: {type(e).__name__}: {e}")
        error.__cause__ = e
        return error


def _sync_weights(
    captured: Captured, plan: Plan, layout: Layout, workers: dict[int, StageWorker],
    device: torch.device, wait: datetime.timedelta,
) -> None:
    """Every rank's stage tensors := global rank 0's (rank 0 holds them all in its captured
    graph): ranks seeded differently still train one model."""
    mine = [t for _, t in stage_state([workers[s].program.module for s in sorted(workers)])]
    sources: dict[int, list[torch.Tensor]] = {}
    if dist.get_rank() == 0:
        by_position: dict[int, list[torch.Tensor]] = {}
        for replica in layout.replicas:
            for position, global_rank in enumerate(replica):
                if global_rank == 0:
                    continue
                if position not in by_position:
                    modules = [split_stage(captured.gm, plan, s).module for s in plan.stages_on(position)]
                    by_position[position] = [t for _, t in stage_state(modules)]
                sources[global_rank] = by_position[position]
    sync_from_rank0(mine, sources, device, wait)


def _tied_groups(plan: Plan, layout: Layout, rank: int, wait: datetime.timedelta) -> list[tuple[str, Any]]:
    """Process groups over the ranks that hold each tied parameter. Every rank creates every
    group (new_group is collective), in plan order, replica by replica."""
    mine = []
    made: dict[tuple[int, ...], Any] = {}
    for replica in layout.replicas:
        for tied in plan.tied:
            holders = tuple(sorted({plan.rank_of(s) for s in tied.stages}))
            if len(holders) < 2:
                continue  # the stages holding it share one rank, and so one parameter object
            global_ranks = tuple(replica[h] for h in holders)
            if global_ranks not in made:
                made[global_ranks] = dist.new_group(list(global_ranks), timeout=wait)
            if dist.get_rank() in global_ranks:
                mine.append((tied.fqn, made[global_ranks]))
    return mine
