"""This rank's stages: built from the plan, their weights made real, then made rank 0's.

compile's build → materialise → sync steps. Each stage of this rank is split out of the
captured graph, its tensors made real on this rank's device (a meta model's filled from the
weights or initialised), and wrapped in a :class:`~pipecut.runtime.execution.stage.StageWorker`; then
every rank's stage tensors are set to global rank 0's, as DistributedDataParallel does, and the
process groups of tied weights are made.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipecut.assemble.context import Place
from pipecut.assemble.layout import RankGroups
from pipecut.core.meta import has_meta
from pipecut.core.owned import own_modules
from pipecut.core.program import Captured, StageProgram
from pipecut.errors import InputError
from pipecut.ir import Plan
from pipecut.passes.rewrite.split import split_stage
from pipecut.planning.request import Request
from pipecut.runtime.comm.sync import stage_state, sync_from_rank0
from pipecut.runtime.comm.teardown import close_at_exit
from pipecut.runtime.execution.stage import StageWorker
from pipecut.runtime.state.materialize import materialize_stage, raise_together
from pipecut.runtime.state.weights import WeightSource

__all__ = ["WorkerFactory", "build_workers", "sync_weights", "tied_groups", "worker_factory"]

WorkerFactory = Callable[[StageProgram, Plan, Callable[[Any], Any]], StageWorker]
"""``(program, plan, unflatten_output) -> worker`` on this rank: the eval mode builds its own."""


def worker_factory(request: Request, place: Place, *, to_split: bool = False) -> WorkerFactory:
    """Workers of this rank, compiled where ``RuntimeOptions.compile_stages`` is True ("auto"
    compiles them after the calibration steps timed them eager). With tensor parallelism a stage
    compiles apart from its parameter ops (see :mod:`pipecut.runtime.execution.compiled`), and
    only once split: ``to_split`` makes the flat workers that
    :func:`pipecut.assemble.tensor.split_over_tensor_group` replaces, never compiled (compiling
    swaps the graph whose regions the split reads)."""
    def make(program: StageProgram, for_plan: Plan, unflatten: Callable[[Any], Any]) -> StageWorker:
        worker = StageWorker(
            program, for_plan, rank=place.rank, ranks=list(place.ranks), group=place.group,
            device=place.device, loss_fn=request.loss_fn, unflatten_output=unflatten, timeout=request.wait,
            apart=place.tensor_parallel,
        )
        if request.options.runtime.compile_stages is True and not to_split:
            worker.compile()
        return worker
    return make


def build_workers(request: Request, place: Place, captured: Captured, plan: Plan, source: WeightSource | None,
                  make: WorkerFactory) -> tuple[Captured, dict[int, StageWorker]]:
    """The workers of this rank's stages, their tensors real on its device; the captured graph
    they were split from (this rank's copy where the model is on meta). A rank that cannot
    build its stage fails together with every other where weights are loaded."""
    if has_meta(captured.gm):  # this rank's copy (meta: no storage); only its stage becomes real
        with warnings.catch_warnings():  # torch's own pytree warns while copying export's specs
            warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated", category=FutureWarning)
            captured = dataclasses.replace(captured, gm=copy.deepcopy(captured.gm))
    workers = {}
    failure: BaseException | None = None
    for stage in plan.stages_on(place.rank):
        # a tensor-parallel stage is segmented after its regions are marked (pipecut.assemble.tensor)
        program = split_stage(captured.gm, plan, stage, segments=not place.tensor_parallel)
        if place.on_fsdp2:
            # FSDP2 swaps the parameter slots of the modules it wraps: the stage's own copies,
            # not the model's (which another pipeline of the same model may train)
            own_modules(program.module)
        try:
            materialize_stage(
                program.module, (captured.gm,), request.model, device=place.device, source=source,
                init=request.weights.init, seed=request.weights.seed, where=f"stage {stage} (rank {dist.get_rank()})",
            )
        except InputError as e:
            failure = failure or e
            continue
        program.module.to(place.device)
        workers[stage] = make(program, plan, captured.unflatten_output)
    if source is not None or has_meta(request.model):  # the same on every rank
        raise_together(failure)
    return captured, workers


def sync_weights(request: Request, place: Place, captured: Captured, plan: Plan, workers: dict[int, StageWorker]) -> None:
    """Every rank's stage tensors := global rank 0's (rank 0 holds them all in its captured
    graph): ranks seeded differently still train one model."""
    mine = [t for _, t in stage_state([workers[s].program.module for s in sorted(workers)])]
    sources: dict[int, list[torch.Tensor]] = {}
    if dist.get_rank() == 0:
        by_position: dict[int, list[torch.Tensor]] = {}
        for replica in place.layout.replicas:
            for position, global_rank in enumerate(replica):
                if global_rank == 0:
                    continue
                if position not in by_position:
                    modules = [split_stage(captured.gm, plan, s).module for s in plan.stages_on(position)]
                    by_position[position] = [t for _, t in stage_state(modules)]
                sources[global_rank] = by_position[position]
    sync_from_rank0(mine, sources, place.device, request.wait)


def tied_groups(plan: Plan, layout: RankGroups, request: Request) -> list[tuple[str, Any]]:
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
                made[global_ranks] = dist.new_group(list(global_ranks), timeout=request.wait)
                close_at_exit([made[global_ranks]])  # a no-op where this rank is not a member
            if dist.get_rank() in global_ranks:
                mine.append((tied.fqn, made[global_ranks]))
    return mine
