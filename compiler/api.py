"""``pipecut.compile``: every rank captures, rank 0 plans, all ranks run the same plan.

:func:`compile` reads as its steps: options → (data-parallel layout) → build (settings →
weights source → connect → capture, plan, broadcast, check → other mode → stages and their
weights → sync → runtime) → live calibration (and one rebuild where the split moved) → data
parallelism. Each step lives in the module that owns it (:mod:`pipecut.assemble`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from pipecut.assemble.choice import (
    capture_and_broadcast_plan,
    check_tensor_group,
    runnable_schedule,
)
from pipecut.assemble.context import Place, connect
from pipecut.assemble.layout import auto_layout
from pipecut.assemble.replay import settings_of
from pipecut.assemble.resolve import WireSpecs, schedules
from pipecut.assemble.tensor import (
    check_composable,
    copy_group,
    split_over_tensor_group,
    tensor_shards,
)
from pipecut.assemble.workers import (
    WorkerFactory,
    build_workers,
    sync_weights,
    tied_groups,
    worker_factory,
)
from pipecut.capture.modes import Adapt, Modes, derive_other_mode
from pipecut.core.kinds import DataParallelKind, ScheduleKind
from pipecut.core.program import Captured, Inputs
from pipecut.errors import CaptureError, PipecutError, PlanError
from pipecut.ir import Plan
from pipecut.options import (
    AUTO,
    CaptureOptions,
    DataParallelOptions,
    MeasureOptions,
    PartitionOptions,
    RuntimeOptions,
    ScheduleOptions,
    TensorParallelOptions,
    WeightOptions,
    options_of,
    requested,
)
from pipecut.passes.costs.stages import predicted_timeline
from pipecut.passes.partition.solve import Devices
from pipecut.planning.asked import replanned, replay_groups, tensor_group
from pipecut.planning.request import Request
from pipecut.profile.compiled import check_auto, measure_and_choose
from pipecut.profile.live import measure_stages, recalibrate
from pipecut.profile.nodes import LossFn
from pipecut.runtime.built import BuiltPipeline, Groups, parameter_aliases, recosted, replicated
from pipecut.runtime.comm.launch import ready_for_p2p
from pipecut.runtime.execution.stage import StageWorker
from pipecut.runtime.grads.data_parallel import replicate
from pipecut.runtime.pipeline import Pipeline
from pipecut.runtime.state.materialize import check_unexpected
from pipecut.runtime.state.weights import WeightSource, open_weights

__all__ = ["compile"]


def compile(
    model: torch.nn.Module,
    example_inputs: Inputs,
    devices: Devices | Any = None,
    *,
    loss_fn: LossFn,
    target: Any = None,
    microbatches: int | Literal["auto"] | None = None,
    schedule: ScheduleKind | str | None = None,
    plan: Plan | str | Path | None = None,
    capture: CaptureOptions | None = None,
    measure: MeasureOptions | None = None,
    partition: PartitionOptions | None = None,
    scheduling: ScheduleOptions | None = None,
    data_parallel: DataParallelOptions | DataParallelKind | str | None = None,
    weights: WeightOptions | str | Path | Any = None,
    runtime: RuntimeOptions | None = None,
    tensor_parallel: TensorParallelOptions | None = None,
) -> Pipeline:
    """Build this rank's stage of ``model`` pipelined over the ranks of the process group.

    Run the same call on every rank (under torchrun). Global rank 0 captures, profiles and
    partitions, and broadcasts the plan, so every rank runs the same plan; then (unless
    ``MeasureOptions.calibration_steps`` is 0) the built pipeline runs that many timed steps,
    its costs are scaled to what each stage took, and it is planned again (rebuilt once where
    the split moves). One microbatch on several ranks logs a warning. ``model`` is left as it is.

    Args:
        model: The model; on the meta device, each rank allocates only its stage's tensors and
            fills them from ``weights`` (or initialises them).
        example_inputs: One full batch: a tuple of positional tensors or a dict of keyword
            tensors.
        devices: K (one stage per rank of the default group), a list of K devices, or a
            DeviceMesh with a "pp" dimension and maybe "dp" (each of the D replicas training on
            its own share of the batch) and "tp" (each stage's layers split over T ranks, see
            ``tensor_parallel``); None: every rank of the default group.
        loss_fn: ``loss_fn(output, target)``, the loss of one microbatch.
        target: The full batch's target for ``loss_fn``.
        microbatches: Microbatches per step, or "auto" (the planner chooses); None: "auto",
            or the plan's with ``plan=``.
        schedule: A :class:`~pipecut.core.kinds.ScheduleKind` or its name, or "auto"; None:
            "auto" beside "auto" microbatches, GPipe beside a count, or the plan's.
        plan: A :class:`~pipecut.ir.Plan` or a JSON path to replay without profiling.
        capture: How the graph is captured (:class:`~pipecut.options.CaptureOptions`).
        measure: Where and how costs and the link are measured
            (:class:`~pipecut.options.MeasureOptions`).
        partition: The solver, recompute, a split you choose
            (:class:`~pipecut.options.PartitionOptions`).
        scheduling: Stages per rank (:class:`~pipecut.options.ScheduleOptions`).
        data_parallel: With a "dp" dimension, "ddp" (the default) or "fsdp" (FSDP2
            ``fully_shard``) over the replicas; "auto" (``devices`` None or the world size N):
            rank 0 chooses D replicas x K stages by predicted step and every rank builds that
            mesh; or a :class:`~pipecut.options.DataParallelOptions`.
        weights: Where a meta model's weights come from: a ``.safetensors`` file, a
            ``save_pretrained`` directory, a pipecut checkpoint, a state dict, or a
            :class:`~pipecut.options.WeightOptions` (``init=``, ``seed=``). Every rank's stage
            weights are set to global rank 0's.
        runtime: Timeouts, host memory, loss reduction, compiled stages
            (:class:`~pipecut.options.RuntimeOptions`).
        tensor_parallel: With a "tp" dimension: which layers split, as column, row or
            vocabulary shards (:class:`~pipecut.options.TensorParallelOptions`); by default the
            model's ``tp_plan``, else the column/row pairs of its graph.

    Returns:
        This rank's :class:`~pipecut.runtime.pipeline.Pipeline`: ``step``, ``parameters`` (this
        rank's stage only), ``state_dict`` under the model's names, ``save_pretrained``.

    Raises:
        InputError: An argument is not valid (an unknown option, devices that do not match the
            process group, ``data_parallel`` without replicas).
        PlanError: ``plan=`` was made for another model or world size, or an argument
            contradicts it, or it splits stages over tensor-parallel groups of T GPUs (a cluster
            plan) and ``devices`` is not a DeviceMesh with a "tp" dimension of T, or it asks what
            tensor-parallel stages do not run (DDP on a torch without FSDP2's replicate).
        CaptureError: The model cannot be captured (raised when the failing mode is used).
        PipelineRuntimeError: Another rank failed while planning or building.
    """
    given = None if plan is None else plan if isinstance(plan, Plan) else Plan.from_json(plan)
    if given is not None:
        check_tensor_group(given, devices)
    carried, unasked = replay_groups(given, capture=capture, runtime=runtime, tensor_parallel=tensor_parallel)
    groups = requested(  # a replayed plan carries how it was captured and run
        microbatches=microbatches, schedule=schedule, data_parallel=data_parallel,
        groups={"capture": carried["capture"], "measure": measure, "partition": partition, "scheduling": scheduling,
                "runtime": carried["runtime"], "weights": _weight_options(weights),
                "tensor_parallel": tensor_group(carried["tensor_parallel"], devices)})
    request = Request(model=model, devices=devices, example_inputs=example_inputs, loss_fn=loss_fn,
                      target=target, options=options_of(groups), weights=groups["weights"], given=given,
                      unasked=unasked)
    check_auto(request.options.runtime.compile_stages, calibrates=_calibrates(request), origin=request.whence("runtime"))
    if request.options.data_parallel.kind == AUTO:
        request = _with_replicas(request)
    built, place = _build(request)
    moved, request, first = _time_stages_and_replan(request, built, place)
    if isinstance(moved, Plan):  # one build alive at a time: two would double every rank's peak memory
        del built
        gc.collect()
        replay = replanned(request.options)
        request = dataclasses.replace(request, given=moved, remeasure=True, options=replay)
        built, place = _build(request)
        back, request, _ = _time_stages_and_replan(request, built, place, first)
        if isinstance(back, Plan):  # the moved split measured slower: the first one, built again, untimed
            del built
            gc.collect()
            request = dataclasses.replace(request, given=back, remeasure=False, options=replay)
            built, place = _build(request)
        else:
            built = back
    else:
        built = moved
    return Pipeline(_replicated(built, place))


def _build(request: Request) -> tuple[BuiltPipeline, Place]:
    """This rank's pipeline: the steps from settings to the runtime object."""
    settings = settings_of(request.given, request.options, request.devices)
    source = _weight_source(request)
    place = connect(request, settings)
    chosen = capture_and_broadcast_plan(request, place, settings)
    sched = runnable_schedule(chosen.plan, place)
    derived = other_mode(request.model, chosen.first, chosen.captured, chosen.plan, request.options.capture.leaf_modules)
    make = worker_factory(request, place)
    flat = worker_factory(request, place, to_split=True) if place.tensor_parallel else make
    shards = None
    if place.tensor_parallel:  # refused before any tensor is made
        shards = tensor_shards(request.model, chosen.plan, request.options.tensor_parallel)
        check_composable(chosen.plan, place, shards, request.model)
    captured, workers = build_workers(request, place, chosen.captured, chosen.plan, source, flat)
    sync_weights(request, place, captured, chosen.plan, workers)
    if shards is not None:
        workers = split_over_tensor_group(place, chosen.plan, captured, chosen.first, workers, shards, make,
                                          settings.sequence_parallel,
                                          request.whence("tensor_parallel"))
    ready_for_p2p(place.group, place.device)
    groups = Groups(
        pipeline=place.group, tied=tuple(tied_groups(chosen.plan, place.layout, request)),
        data_parallel=place.layout.dp_group,
        tensor=place.layout.tp_mesh.get_group() if place.layout.tp_mesh is not None else None,
        # checkpoints of split stages are written by every rank of the copy
        state=copy_group(place.layout, request.wait) if shards is not None else None)
    built = BuiltPipeline(
        plan=chosen.plan, captured=captured, workers=workers, schedule=sched, rank=place.rank,
        ranks=tuple(place.ranks), groups=groups, aliases=parameter_aliases(captured),
        loss_reduction=request.options.runtime.loss_reduction,
        modes=_modes(request, place, workers, derived, flat, None if shards is None else functools.partial(
            _split_other_mode, place, chosen.first, shards, make, settings.sequence_parallel,
            request.whence("tensor_parallel"))),
        wire=WireSpecs(captured.gm, chosen.plan, place.device),
        schedule_for=schedules(chosen.plan), predicted=tuple(predicted_timeline(chosen.plan)), timeout=request.wait,
    )
    return built, place


def _calibrates(request: Request) -> bool:
    """Live calibration runs: the plan is made here (or a moved split is measured again) from
    timings (``MeasureOptions(estimate=...)`` times nothing)."""
    measure = request.options.measure
    return (request.given is None or request.remeasure) and measure.calibration_steps > 0 and measure.estimate is None


REVERT_MARGIN = 0.03
"""A moved split whose measured step is slower than the first split's by more than this
fraction is given up for the first (two medians of a few steps each differ by about 1-2% on an
idle machine here)."""


@dataclasses.dataclass(frozen=True)
class _FirstSplit:
    """On rank 0: the first build's plan, its costs scaled to its own stage times (the split
    kept), and the step it measured."""

    plan: Plan
    step_ms: float


def _time_stages_and_replan(request: Request, built: BuiltPipeline, place: Place, first: _FirstSplit | None = None,
                            ) -> tuple[BuiltPipeline | Plan, Request, _FirstSplit | None]:
    """Live calibration: time the stages of the built pipeline (with compile_stages="auto",
    eager and compiled, one kept), scale the costs to them and partition again on rank 0. The
    build with the new costs is returned where the split stays (or is being measured again); the new
    plan is returned where the split moved, to build again (its prediction then comes from its
    own stages' times, and that split is kept), with the request that builds it and, on rank 0,
    the first split measured. Measuring a moved split (``first`` given): where it stepped
    slower than the first split by more than :data:`REVERT_MARGIN`, the first split's plan is
    returned instead, to build again: the calibrated costs predicted the move to pay, the clock
    says it did not, and the clock decides."""
    if not _calibrates(request):
        return built, request, None
    pipe = Pipeline(built)  # run for timing only; the pipeline returned to the user is made afresh
    steps, note = request.options.measure.calibration_steps, ""
    if request.options.runtime.compile_stages == AUTO:
        choice, times = measure_and_choose(pipe, request.example_inputs, request.target, steps)
        request, note = _chosen_mode(request, choice.compiled), choice.note()
    else:
        times = measure_stages(pipe, request.example_inputs, request.target, steps)  # before FSDP changes the modules
    again: list[Any] = [None, None]
    measured: _FirstSplit | None = None
    if dist.get_rank() == 0:
        made = recalibrate(pipe.plan, times, place.replication, moved=request.remeasure)
        if note:  # the plan replays with the mode chosen, and says why
            made = dataclasses.replace(made.noted(note), options=request.options)
        again[0] = made.to_json()
        if first is not None and times.step_ms > first.step_ms * (1 + REVERT_MARGIN):
            again[1] = first.plan.noted(f"calibration moved the split to stages of {_sizes(made)} nodes, which "
                                          f"measured {times.step_ms:.1f} ms a step against {first.step_ms:.1f} ms "
                                          f"for this split: this split kept").to_json()
        elif not request.remeasure and not made.runs_like(pipe.plan):
            kept = recalibrate(pipe.plan, times, place.replication, keep_split=True)
            # the first split, should the moved one measure slower, says how its stages run too
            measured = _FirstSplit(dataclasses.replace(kept.noted(note), options=made.options), times.step_ms)
    dist.broadcast_object_list(again, src=0)
    if again[1] is not None:
        return Plan.from_json(again[1]), request, None
    recalibrated = Plan.from_json(again[0])
    if request.remeasure or recalibrated.runs_like(pipe.plan):  # same split: keep this build
        return recosted(built, recalibrated, runnable_schedule(recalibrated, place), schedules(recalibrated),
                        predicted_timeline(recalibrated)), request, None
    return recalibrated, request, measured


def _chosen_mode(request: Request, compiled: bool) -> Request:
    """``request`` with compile_stages="auto" resolved to the mode chosen."""
    runtime = dataclasses.replace(request.options.runtime, compile_stages=compiled)
    return dataclasses.replace(request, options=dataclasses.replace(request.options, runtime=runtime))


def _sizes(plan: Plan) -> str:
    return "/".join(str(len(s.nodes)) for s in plan.stages)


def _replicated(built: BuiltPipeline, place: Place) -> BuiltPipeline:
    """Data parallelism over the replicas, after the build has read the parameter names FSDP
    may change (a refusal names the engine's origin where the user did not choose it)."""
    if place.replication is None:
        return built
    assert place.layout.dp_group is not None  # replication_of gives None without a "dp" dimension
    kind, tensor_parallel = place.replication.resolved_kind, place.tensor_parallel
    wrapped = replicate(built.workers, built.schedule[place.rank], kind, group=place.layout.dp_group,
                        mesh=place.layout.dp_mesh, tensor_parallel=tensor_parallel)
    modes = built.modes
    if place.on_fsdp2 and modes is not None:
        # FSDP2 swapped the captured mode's parameters for its own; the other mode's
        # programs (an export graph fixes its mode) would run the tensors of compile time,
        # silently (found by the fuzzer, issue 27).
        mode = "eval" if modes.captured_training else "train"
        default = f" ({place.engine_origin})" if place.engine_origin else ""
        modes = modes.without_separate_mode(PlanError(
            f"{mode} mode under data_parallel='{kind.value}'{default}{' with tensor parallelism' if tensor_parallel else ''} "
            f"is not supported for a model captured by torch.export (its {mode}-mode graph is a second "
            f"program, which FSDP2 does not wrap): use data_parallel='ddp' without tensor parallelism, "
            f"or run {mode} steps outside the pipeline (pipe.state_dict() gives the full weights)"))
    return replicated(built, wrapped, modes)


def _with_replicas(request: Request) -> Request:
    """data_parallel="auto": the layout rank 0 chose (D × K), to replay on this rank's share."""
    chosen, (share, share_target) = auto_layout(request)
    options = dataclasses.replace(
        replanned(request.options),
        data_parallel=DataParallelOptions(kind=None if chosen.mesh is None else chosen.kind))
    return dataclasses.replace(
        request, devices=chosen.mesh if chosen.mesh is not None else chosen.plan.num_ranks,
        example_inputs=share, target=share_target, given=chosen.plan, options=options,
        unasked=(*request.unasked, ("data_parallel", f"chosen by data_parallel={AUTO!r}")))


def _weight_options(weights: Any) -> WeightOptions | None:
    """``weights=``: the options object, or just where the weights are."""
    if weights is None or isinstance(weights, WeightOptions):
        return weights
    return WeightOptions(source=weights)


def _weight_source(request: Request) -> WeightSource | None:
    """The weights opened and checked against the model before anything else runs."""
    if request.weights.source is None:
        return None
    source = open_weights(request.weights.source)  # type: ignore[arg-type]
    check_unexpected(source, request.model)
    return source


def _split_other_mode(place: Place, first: Inputs, shards: Mapping[str, Any], make: WorkerFactory, sequence_parallel: bool,
                      origin: str, other: Captured, plan: Plan, built: Mapping[int, StageWorker]) -> dict[int, StageWorker]:
    """The other train/eval mode's stages (an export graph fixes its mode) split over the tensor
    group as the compiled mode's are; their parameters are that mode's DTensors already."""
    return split_over_tensor_group(place, plan, other, first, built, shards, make, sequence_parallel, origin)


def _modes(request: Request, place: Place, workers: Any, derived: Any, make: WorkerFactory, adapt: Adapt | None) -> Modes:
    return Modes(model=request.model, workers=workers, derived=derived, make_worker=make, device=place.device, adapt=adapt,
                 make_wire=lambda captured, plan: WireSpecs(captured.gm, plan, place.device))


def other_mode(
    model: torch.nn.Module, first: Inputs, captured: Captured, plan: Plan, leaf_modules: Any
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
