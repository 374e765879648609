"""Tensor parallelism inside each stage: which parameters split, checked, then the stages split.

compile's step after the weights are synchronised, with a "tp" dimension in the DeviceMesh.
Where the split comes from, first that applies:

1. the user's plan, ``TensorParallelOptions(plan={"model.layers.*.mlp.up_proj": "column", ...})``;
2. the model's own: a Hugging Face model's ``tp_plan`` (``config.base_model_tp_plan`` under its
   base model's prefix), ``colwise`` → column, ``rowwise`` → row, ``embedding_rowwise`` →
   vocab; styles without a plain column/row meaning (packed or expert weights, ``gather``,
   ``sequence_parallel``) leave their parameters whole;
3. the graph: Megatron's pairs found by :func:`pipecut.passes.parallel.tensor.parameter_shards`.

Everything that cannot run is refused before any step, by name: a count of heads or a split
dimension that the group size does not divide, a schedule or engine that does not compose yet,
and an op of a stage that DTensor cannot run on its split values (each stage runs once at build
time, on zeros, and on random values where zeros fail: DTensor propagates shardings there as in
every step).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import pathlib
import re
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor
import torch.fx as fx

from pipecut.assemble.context import Place
from pipecut.assemble.layout import RankGroups
from pipecut.core.kinds import DataParallelKind, Recompute, TensorShard
from pipecut.core.program import Captured, Inputs
from pipecut.core.segment import Segment
from pipecut.errors import InputError, PlanError
from pipecut.ir import Plan
from pipecut.options import TensorParallelOptions
from pipecut.passes.parallel.tensor import ParameterShard, parameter_shards, tensor_sizes
from pipecut.passes.rewrite.segments import checkpoint_segments
from pipecut.passes.rewrite.split import split_stage
from pipecut.passes.rewrite.tensor_regions import ATTENTION, region_nodes, shard_regions
from pipecut.planning.tensor_parallel import head_counts
from pipecut.runtime.comm.teardown import close_at_exit
from pipecut.runtime.execution.stage import StageWorker
from pipecut.runtime.execution.tensor_parallel import (
    AttentionSplitError,
    TokenWire,
    region_ends,
    shard_module,
)
from pipecut.runtime.grads.data_parallel import can_replicate_dtensors
from pipecut.runtime.state.materialize import raise_together

__all__ = ["MODEL_STYLES", "check_composable", "copy_group", "split_over_tensor_group", "tensor_shards", "token_cuts"]

MODEL_STYLES: Mapping[str, TensorShard] = {
    "colwise": TensorShard.COLUMN, "colwise_gather_output": TensorShard.COLUMN, "local_colwise": TensorShard.COLUMN,
    "rowwise": TensorShard.ROW, "rowwise_split_input": TensorShard.ROW, "local_rowwise": TensorShard.ROW,
    "embedding_rowwise": TensorShard.VOCAB,
}
"""Hugging Face ``tp_plan`` styles that are a plain column, row or vocabulary split of a module's
``weight`` (and a column's ``bias``); any other style leaves the module's parameters whole."""


def model_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """A Hugging Face model's tensor-parallel plan, module patterns → style (empty: none)."""
    own = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if own:
        return dict(own)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    return {prefix + k: v for k, v in base.items()}


def _pattern(module: str) -> re.Pattern[str]:
    """``layers.*.mlp`` as a regular expression: ``*`` is one name of the path."""
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in module.split(".")))


def _from_styles(styles: Mapping[str, TensorShard], params: Mapping[str, torch.Size]) -> dict[str, ParameterShard]:
    """Module patterns → kind, as parameter splits: a matrix ``weight`` (out, in) along 0 for
    column and vocab, 1 for row; a ``bias`` along 0 for column."""
    patterns = [(_pattern(m), kind) for m, kind in styles.items() if kind is not TensorShard.REPLICATED]
    out = {}
    for fqn, shape in params.items():
        owner, _, leaf = fqn.rpartition(".")
        kind = next((k for p, k in patterns if p.fullmatch(owner)), None)
        if kind is None:
            continue
        if leaf == "weight" and len(shape) == 2:
            out[fqn] = ParameterShard(kind=kind, dim=1 if kind is TensorShard.ROW else 0)
        elif leaf == "bias" and len(shape) == 1 and kind is TensorShard.COLUMN:
            out[fqn] = ParameterShard(kind=kind, dim=0)
    return out


def tensor_shards(model: torch.nn.Module, plan: Plan, options: TensorParallelOptions) -> dict[str, ParameterShard]:
    """Every split parameter of the plan, by the model's name: the user's plan, else the model's
    ``tp_plan``, else the graph's pairs (see the module docstring)."""
    planned = {fqn for stage in plan.stages for fqn in stage.parameters}
    params = {fqn: p.shape for fqn, p in model.named_parameters() if fqn in planned}
    if options.plan:
        return _from_styles(dict(options.plan), params)
    styles = {m: MODEL_STYLES.get(s, TensorShard.REPLICATED) for m, s in model_tp_plan(model).items()}
    if any(k is not TensorShard.REPLICATED for k in styles.values()):
        return _from_styles(styles, params)
    classes = {name: type(m).__name__ for name, m in model.named_modules()}
    return {fqn: s for fqn, s in parameter_shards(plan.nodes, classes).items() if fqn in params}


def check_composable(plan: Plan, place: Place, shards: Mapping[str, ParameterShard], model: torch.nn.Module) -> None:
    """Refuse, before anything is split, what tensor parallelism does not run (yet)."""
    t = place.layout.tensor_parallel
    if (place.replication is not None and place.replication.resolved_kind is not DataParallelKind.FSDP
            and not can_replicate_dtensors()):
        raise PlanError(f"data_parallel={place.replication.resolved_kind.value!r} with tensor parallelism needs torch's FSDP2-based replicate "
                        f"(torch.distributed._composable.replicate_with_fsdp), which torch {torch.__version__} "
                        f"lacks (DistributedDataParallel does not reduce DTensor gradients); use "
                        f"data_parallel='fsdp', or a newer torch")
    heads = head_counts(model)
    uneven = {name: n for name, n in heads.items() if n % t}
    if uneven:
        raise InputError(
            f"tensor_parallel={t} (the mesh's 'tp' dimension) must divide the "
            f"{' and the '.join(f'{k} ({v})' for k, v in uneven.items())} of the model's config: a tensor group "
            f"splits whole heads; group sizes that run: {', '.join(map(str, tensor_sizes(math.gcd(*heads.values()), tuple(heads.values()))))}")
    bad = {fqn: (s.dim, int(model.get_parameter(fqn).shape[s.dim])) for fqn, s in shards.items()
           if model.get_parameter(fqn).shape[s.dim] % t}
    if bad:
        raise InputError(
            "tensor_parallel=" + str(t) + " must divide every split dimension: " + ", ".join(
                f"{fqn} (dimension {d} of size {n})" for fqn, (d, n) in sorted(bad.items()))
            + "; use a group size that divides them, or TensorParallelOptions(plan=...) keeping them whole")


def copy_group(layout: RankGroups, timeout: datetime.timedelta) -> dist.ProcessGroup | None:
    """The group of the ranks holding this rank's copy of the model (its pipeline's stages and
    their tensor shards), over which a checkpoint is written and read. Collective: every rank
    makes every replica's group, in order."""
    mine = None
    for ranks in layout.copies:
        group = dist.new_group(list(ranks), timeout=timeout)
        close_at_exit([group])  # a no-op where this rank is not a member
        if dist.get_rank() in ranks:
            mine = group
    return mine


class _Tracing(fx.Interpreter):
    """Runs a stage node by node, remembering the node it is at (to name it in an error)."""

    at: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.at = n
        return super().run_node(n)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        sub = self.fetch_attr(target)
        if not isinstance(sub, Segment):
            return super().call_module(target, args, kwargs)
        inner = _Tracing(sub.interpretable())  # a recomputed run: the node inside it is named
        try:
            return inner.run(*args)
        except Exception:
            self.at = inner.at
            raise


def split_over_tensor_group(place: Place, plan: Plan, captured: Captured, first: Inputs,
                            workers: Mapping[int, StageWorker], shards: Mapping[str, ParameterShard],
                            make: Any, sequence_parallel: bool = False, origin: str = "") -> dict[int, StageWorker]:
    """This rank's stages with their split parameters as DTensors and their graphs in regions
    (:func:`pipecut.passes.rewrite.tensor_regions.shard_regions`; ``sequence_parallel``: the
    residual stream between them split along its tokens, and across cuts in token shards:
    :func:`token_cuts`), a stage planned with selective recompute then segmented (it comes
    flat from ``build_workers``), each run once on zeros (or random values); new workers over
    them. ``origin``: where ``sequence_parallel`` came from when this call did not pass it
    ("recorded in the replayed plan's options"), for a refusal's fix.
    Collective over every rank: one that cannot split its stage fails all."""
    mesh = place.layout.tp_mesh
    ends = region_ends(mesh, sequence_parallel)
    inputs = dict(zip(captured.input_names, captured.flatten_inputs(first)))
    public = captured.names.public if captured.names is not None else (lambda n: n)
    cuts = token_cuts(captured.gm, plan, shards, public) if sequence_parallel else {}
    out: dict[int, StageWorker] = {}
    failure: BaseException | None = None
    dtensors: dict[int, torch.nn.Parameter] = {}  # one per parameter, whichever of the rank's stages hold it
    for s, worker in sorted(workers.items()):
        program = worker.program
        mine = _stage_shards(program.module, shards, public)
        arriving, sent = cuts.get(s, (frozenset(), frozenset()))
        regions = region_nodes(program.module, mine, sequence_parallel, arriving)
        refused = _attention_on_tokens(program.module, regions.spread, s, origin)
        shard_module(program.module, {name: shard.dim for name, shard in mine.items()}, mesh,
                     replicated=_called_on_dtensors(program.module, mine, regions.inside | regions.spread),
                     made=dtensors)
        split = shard_regions(program.module, mine, enter=ends.enter, leave=ends.leave, whole=ends.whole, join=ends.join,
                              heads=ends.heads, arriving=arriving, sends_tokens=bool(sent))
        stage = plan.stages[s]
        if stage.recompute is Recompute.SELECTIVE:  # its recomputed runs, now on DTensors, as segments
            kept = {n.name for n in split.graph.nodes}  # the regions drop export's metadata checks
            split = checkpoint_segments(split, [n for n in stage.recomputed if n in kept], where=f"stage {s}")
        program = dataclasses.replace(program, module=split)
        made = make(program, plan, captured.unflatten_output)
        if arriving or sent:
            made.tokens = TokenWire(mesh, arriving | sent)
        try:
            if refused is not None:
                raise refused
            _run_once(program.module, made, inputs, s, regions.spread, origin)
        except PlanError as e:
            failure = failure or e
        out[s] = made
    raise_together(failure, "split its stage over its tensor-parallel group")
    return out


def _whole_tokens(origin: str, first: bool = False) -> str:
    """The fix that turns sequence parallelism off (``first``: to begin a sentence): leaving it
    out turns it off, unless a replayed plan's options carry it (``origin``)."""
    if not origin:
        fix = "leave TensorParallelOptions(sequence_parallel=False)"
    else:
        fix = (f"pass tensor_parallel=TensorParallelOptions(sequence_parallel=False) (sequence parallelism here "
               f"is {origin}; give its plan= too, if it records one)")
    return fix[0].upper() + fix[1:] if first else fix


def _attention_on_tokens(module: fx.GraphModule, spread: Collection[str], stage: int,
                         origin: str = "") -> PlanError | None:
    """Attention outside every split region on the residual stream's token shards (its query,
    key and value projections left whole, as DeepSeek-V3's MLA under the model's tp_plan): it
    would attend within each rank's tokens only, or fail on a mask of the whole sequence.
    Refused by node before any step (a token-mixing op cannot run on a token shard)."""
    node = next((n for n in module.graph.nodes if n.name in spread and n.target in ATTENTION), None)
    if node is None:
        return None
    return PlanError(
        f"stage {stage} (rank {dist.get_rank()}) cannot run split over its tensor-parallel group: node {node.name} "
        f"({node.format_node()}), an attention outside every split region, would read the residual stream's token "
        f"shards (sequence parallelism) as whole sequences: its query, key and value projections are not split. "
        f"{_whole_tokens(origin, first=True)}, or split those projections with TensorParallelOptions(plan=...)")


def _stage_shards(module: torch.nn.Module, shards: Mapping[str, ParameterShard],
                  public: Any) -> dict[str, ParameterShard]:
    """The split parameters of a stage module, by its own names (a tied weight's may be an alias
    of the model's)."""
    return {name: shards[public(name) or name] for name, _ in module.named_parameters(remove_duplicate=False)
            if (public(name) or name) in shards}


def token_cuts(gm: fx.GraphModule, plan: Plan, shards: Mapping[str, ParameterShard],
               public: Any) -> dict[int, tuple[frozenset[str], frozenset[str]]]:
    """Sequence parallelism: per stage, the cut values it receives and those it sends as token
    shards (the residual stream between split regions), stage after stage along the plan (what
    one sends, the next receives); every rank derives the same from the captured graph. The last
    stage sends nothing: what it returns goes whole to the loss."""
    out = {}
    arriving: frozenset[str] = frozenset()
    for stage in plan.stages:
        program = split_stage(gm, plan, stage.index, segments=False)  # as the stage is split into regions
        regions = region_nodes(program.module, _stage_shards(program.module, shards, public), True, arriving)
        sent: frozenset[str] = frozenset()
        if not program.is_last:
            returned = next(n for n in program.module.graph.nodes if n.op == "output").args[0]
            sent = frozenset(name for name, node in zip(program.sent, returned)
                             if isinstance(node, fx.Node) and node.name in regions.closing | regions.spread)
        out[stage.index] = (arriving, sent)
        arriving = sent
    return out


def _called_on_dtensors(module: fx.GraphModule, split: Mapping[str, ParameterShard], on: Collection[str]) -> list[str]:
    """The parameters that a module called on DTensors (the nodes named in ``on``) holds whole:
    an ``nn.Linear``'s bias beside its row-split weight, a norm's weight on a token shard. The
    module's forward reads them directly, and DTensor mixes no plain tensor into a product, so
    they are replicated DTensors."""
    called = [f"{n.target}." for n in module.graph.nodes if n.op == "call_module" and n.name in on]
    return [name for name, _ in module.named_parameters(remove_duplicate=False)
            if name not in split and any(name.startswith(prefix) for prefix in called)]


def _probe_values(worker: StageWorker, fill: str) -> list[Any]:
    """What the stage receives, as ``fill`` ("zeros", or "random": floating values drawn from a
    generator seeded alike on every rank of the group, integers zero) of its planned shapes (on
    the wire: a token shard's is this rank's tokens)."""
    if worker.prev is None:
        return []
    generator = torch.Generator().manual_seed(0)
    leaves = []
    for leaf in worker.in_spec.tensors:
        shape = worker.wire_shape(worker.in_spec, leaf)
        value = torch.zeros(shape, dtype=leaf.dtype)
        if fill == "random" and value.is_floating_point():
            value = torch.randn(shape, generator=generator).to(leaf.dtype)
        leaves.append(value.to(worker.device))
    return worker.arrived(leaves, worker.in_spec)


_DTENSOR_CODE = str(pathlib.Path(torch.distributed.tensor.__file__).parent)


def _split_failure(e: BaseException) -> bool:
    """Whether ``e`` comes from running the stage split, which the probe refuses by node: DTensor's
    own refusal to run an op on split values (no sharding rule, a redistribution it cannot make:
    raised by DTensor's code), or attention on tokens the split made disagree
    (:class:`~pipecut.runtime.execution.tensor_parallel.AttentionSplitError`). Not a kernel's
    error on the probe's made-up values (an index out of range on a received index tensor of
    zeros: raised by the op DTensor called, even when DTensor called it)."""
    if isinstance(e, AttentionSplitError):
        return True
    tb, innermost = e.__traceback__, None
    while tb is not None:
        innermost, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return innermost is not None and innermost.startswith(_DTENSOR_CODE)


def _run_once(module: fx.GraphModule, worker: StageWorker, inputs: Mapping[str, Any], stage: int,
              spread: Collection[str], origin: str = "") -> None:
    """One forward of the split stage on made-up values of its planned inputs (no gradients, no
    state kept): DTensor refuses an op it cannot propagate here, as it would in the first step.
    Zeros first, then random values where zeros fail: a model that routes or indexes on the
    values it receives (a mixture of experts) can fail on zeros alone, which no step sends.
    Uninitialised memory is filled alike on every rank meanwhile (``torch.empty`` then holds the
    same values on the ranks of the group, so they fail alike instead of parting ways in a
    collective). A failure that is not DTensor's (an index out of range on values no step
    sends) leaves the check to the first step. ``spread``: the nodes that run on token shards
    (sequence parallelism), named as such; ``origin``: where sequence parallelism came from (see
    :func:`split_over_tensor_group`)."""
    kept = [(b, b.clone()) for b in module.buffers()]
    failure: tuple[Exception, fx.Node | None] | None = None
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                     torch.utils.deterministic.fill_uninitialized_memory)  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        for fill in ("zeros", "random"):
            run = _Tracing(module)
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # warn_only: an op without a deterministic kernel
                    run.run(*_probe_values(worker, fill), *[inputs[n] for n in worker.program.model_inputs])
                return
            except Exception as e:
                failure = (e, run.at)
            finally:
                for b, value in kept:  # BatchNorm statistics, counters: as they were
                    b.copy_(value)
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.utils.deterministic.fill_uninitialized_memory = deterministic[2]  # type: ignore[attr-defined]
    assert failure is not None
    error, at = failure
    if not _split_failure(error):
        return
    where = f"node {at.name} ({at.format_node()})" if at is not None else "its graph"
    tokens = isinstance(error, AttentionSplitError) or (at is not None and at.name in spread)
    if tokens:
        where += ", on the residual stream's token shards (sequence parallelism),"
    fix = f"{_whole_tokens(origin)}, keep" if tokens else "Keep"
    raise PlanError(
        f"stage {stage} (rank {dist.get_rank()}) cannot run split over its tensor-parallel group: {where} "
        f"failed on DTensors: {type(error).__name__}: {str(error).splitlines()[0].rstrip('.') if str(error) else ''}. {fix} the "
        f"parameters it reads whole with TensorParallelOptions(plan=...), or run without a 'tp' dimension"
    ) from error
