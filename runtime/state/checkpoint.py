"""Checkpoints per stage under the original model's names, with torch.distributed.checkpoint.

Every rank writes the tensors its stage owns into one DCP checkpoint, keyed by the name the
tensor has in the original model, so the checkpoint does not depend on the partition: it loads
into a pipeline with another number of stages, or into the plain model (no process group).

Keys (one flat dict; ``#pickle`` marks a picklable object stored as a byte tensor, which keeps
DCP from flattening dicts into many keys)::

    model.<fqn>                      parameter or buffer
    optim.<fqn>.<state>              optimizer state of a parameter (AdamW: step, exp_avg, …)
    optim.<fqn>.hparams#pickle       that parameter's group hyperparameters (lr, betas, …)
    rng.<stages>.<stage>             each rank's CPU RNG state (restored when K matches)
    meta.step#pickle, meta.extra#pickle   the training step and the user's extra state

A value held by several stages (a tied weight, a buffer read by two stages) is written once, by
its owner: the stage that writes it in place (a BatchNorm statistic), else the first stage
holding it. DCP writes a checkpoint's ``.metadata`` last, so a directory without it is an
interrupted save; :func:`latest` finds the newest complete one under a root of
:func:`step_dir` directories. The plan is saved beside the tensors (``plan.json``) so a resumed
run can replay it: another partition could sum tied gradients in another order, and the
losses would no longer be bitwise those of an uninterrupted run.

    >>> ckpt.save(pipe, ckpt.step_dir(root, step), opt, step=step)
    >>> pipe = pipecut.compile(model, k, ..., plan=ckpt.latest(root) / ckpt.PLAN_FILE)
    >>> step = ckpt.load(pipe, ckpt.latest(root), opt).step
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

from pipecut.core.graph import mutates_first_arg
from pipecut.errors import InputError
from pipecut.runtime.grads.sharded_optimizer import ShardedStateOptimizer

if TYPE_CHECKING:  # Pipeline calls these modules: a run-time import would be a cycle
    from pipecut.runtime.pipeline import Pipeline

__all__ = [
    "PLAN_FILE",
    "Loaded",
    "latest",
    "load",
    "load_into_model",
    "owned",
    "save",
    "stage_tensors",
    "step_dir",
]

PLAN_FILE = "plan.json"
_COMPLETE = ".metadata"
_PICKLE = "#pickle"
_STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Loaded:
    """What :func:`load` and :func:`load_into_model` restored besides tensors."""

    step: int
    """The training step the checkpoint was saved at."""
    extra: Any = None
    """The ``extra`` object given to :func:`save`."""
    keys: tuple[str, ...] = ()
    """Checkpoint keys read into this rank (or model)."""


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The conventional directory of the checkpoint of ``step`` under ``root``."""
    return Path(root) / f"step-{step:08d}"


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The complete :func:`step_dir` checkpoint with the highest step under ``root``, or None."""
    root = Path(root)
    found = [
        (int(m.group(1)), d)
        for d in (root.iterdir() if root.is_dir() else ())
        if (m := _STEP_DIR.fullmatch(d.name)) and (d / _COMPLETE).exists()
    ]
    return max(found)[1] if found else None


def _pack(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)


def _unpack(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())


def stage_tensors(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """This stage's parameters and buffers by their (first) name in the original model."""
    out: dict[str, torch.Tensor] = {}
    for name, t in [*pipe.named_parameters(), *pipe.named_buffers()]:
        out.setdefault(name, t)
    return out


def _written_in_place(pipe: Pipeline) -> set[str]:
    """Names of the buffers this stage's graph writes in place (``copy_`` of a BN statistic)."""
    names = {id(t): n for n, t in stage_tensors(pipe).items()}
    written = set()
    for module in pipe.modules:  # one per stage this rank runs
        assert isinstance(module, torch.fx.GraphModule)
        buffers = dict(module.named_buffers())
        for node in module.graph.nodes:
            first = node.args[0] if node.args else None
            if (isinstance(first, torch.fx.Node) and first.op == "get_attr"
                    and str(first.target) in buffers and mutates_first_arg(node, module)
                    and id(buffers[str(first.target)]) in names):
                written.add(names[id(buffers[str(first.target)])])
    return written


def owned(pipe: Pipeline) -> set[str]:
    """The names this rank saves, so that each tensor is saved by one stage. Collective."""
    mine = (sorted(stage_tensors(pipe)), sorted(_written_in_place(pipe)))
    everyone: list[Any] = [None] * len(pipe.ranks)
    dist.all_gather_object(everyone, mine, group=pipe.group)
    owner: dict[str, int] = {}
    for stage, (held, _) in enumerate(everyone):
        for name in held:
            owner.setdefault(name, stage)
    for stage, (_, written) in enumerate(everyone):
        for name in written:
            owner[name] = stage  # the copy that is written is the current one
    return {name for name, stage in owner.items() if stage == pipe.stage}


def _optimizer_params(
    pipe: Pipeline, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[str, torch.Tensor, dict[str, Any]]]:
    """(original name, parameter, its param group) for every parameter in ``optimizer``."""
    if isinstance(optimizer, ShardedStateOptimizer):
        raise InputError(
            f"stage {pipe.stage} (rank {dist.get_rank()}): a checkpoint of a data_parallel='zero1' optimizer "
            f"is not supported yet: each replica holds the state of its share of the parameters only, and "
            f"a checkpoint written from one replica would lose the rest. Save the model without it "
            f"(optimizer=None), or train with data_parallel='ddp' where the state must be saved")
    names = {id(t): n for n, t in stage_tensors(pipe).items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise InputError(
                    f"stage {pipe.stage}: the optimizer holds a parameter of shape "
                    f"{tuple(p.shape)} that this stage does not; build it from pipe.parameters()"
                )
            yield names[id(p)], p, group


def _group(pipe: Pipeline) -> dist.ProcessGroup | None:
    """The ranks that write and read the checkpoint together: the pipeline's, or with tensor
    parallelism every rank of the model's copy (each shard of a split tensor is written by its
    rank, DTensor's placements say where it lies in the whole)."""
    return pipe.state_group if pipe.state_group is not None else pipe.group


def _like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A whole tensor read from the checkpoint as ``target`` holds it: this rank's shard of a
    split (DTensor) target, else the tensor on the target's device."""
    if isinstance(target, DTensor):
        return distribute_tensor(value.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
    return value.to(target.device)


def save(pipe: Pipeline, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
         *, step: int = 0, extra: Any = None) -> Path:
    """Save this stage's tensors (and optimizer state) as the checkpoint ``path``. Collective.

    Call on every rank with the same ``path``, after ``optimizer.step()``. ``extra`` is any
    picklable object (a data loader position, a scheduler's state dict), saved by stage 0.
    """
    path = Path(path)
    mine = owned(pipe)
    state: dict[str, Any] = {
        f"model.{n}": t.detach() for n, t in stage_tensors(pipe).items() if n in mine
    }
    if optimizer is not None:
        for name, p, group in _optimizer_params(pipe, optimizer):
            if name not in mine:
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    state[f"optim.{name}.{key}"] = value
                else:
                    state[f"optim.{name}.{key}{_PICKLE}"] = _pack(value)
            hparams = {k: v for k, v in group.items() if k != "params"}
            state[f"optim.{name}.hparams{_PICKLE}"] = _pack(hparams)
    state[f"rng.{len(pipe.ranks)}.{pipe.stage}"] = torch.get_rng_state()
    if pipe.stage == 0:
        state[f"meta.step{_PICKLE}"] = _pack(int(step))
        state[f"meta.extra{_PICKLE}"] = _pack(extra)
        path.mkdir(parents=True, exist_ok=True)
        pipe.plan.to_json(path / PLAN_FILE)
    dcp.save(state, checkpoint_id=path, process_group=_group(pipe))
    return path


def _metadata(path: Path) -> dict[str, Any]:
    if not (path / _COMPLETE).exists():
        raise InputError(
            f"{path} is not a complete checkpoint (no {_COMPLETE}: missing, or its save was "
            f"interrupted); load an earlier one, e.g. pipecut.runtime.state.checkpoint.latest(root)"
        )
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _read(meta: dict[str, Any], keys: list[str], path: Path, **where: Any) -> dict[str, Any]:
    """Load ``keys`` of the checkpoint (tensors, or unpickled objects for ``#pickle`` keys)."""
    state = {}
    for k in keys:
        m = meta[k]
        assert isinstance(m, dcp.TensorStorageMetadata), f"{k} is not a tensor in {path}"
        state[k] = torch.empty(m.size, dtype=m.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, **where)
    return {k: _unpack(v) if k.endswith(_PICKLE) else v for k, v in state.items()}


def _missing_error(where: str, missing: list[str], path: Path) -> InputError:
    return InputError(
        f"{where}: checkpoint {path} lacks {len(missing)} tensor(s), e.g. {missing[:5]}; it was "
        f"saved from another model (or config) than the one loading it"
    )


def load(pipe: Pipeline, path: str | os.PathLike[str],
         optimizer: torch.optim.Optimizer | None = None) -> Loaded:
    """Load a checkpoint saved with any number of stages into this stage. Collective.

    Parameters and buffers are copied in place; the optimizer's per-parameter state and
    hyperparameters are replaced. The RNG state is restored when the checkpoint was saved with
    as many stages as this run has.
    """
    path = Path(path)
    meta = _metadata(path)
    tensors = stage_tensors(pipe)
    missing = [n for n in tensors if f"model.{n}" not in meta]
    if missing:
        raise _missing_error(f"stage {pipe.stage} (rank {dist.get_rank()})", missing, path)
    keys = [f"model.{n}" for n in tensors]
    params = list(_optimizer_params(pipe, optimizer)) if optimizer is not None else []
    for name, _, _ in params:
        keys += [k for k in meta if k.startswith(f"optim.{name}.")]
    rng = f"rng.{len(pipe.ranks)}.{pipe.stage}"
    keys += [k for k in (rng, f"meta.step{_PICKLE}", f"meta.extra{_PICKLE}") if k in meta]
    state = _read(meta, keys, path, process_group=_group(pipe))
    with torch.no_grad():
        for name, t in tensors.items():
            value = _like(state[f"model.{name}"], t)
            (t.to_local() if isinstance(t, DTensor) else t).copy_(value.to_local() if isinstance(value, DTensor) else value)
    for name, p, group in params:
        prefix = f"optim.{name}."
        values = {k.removeprefix(prefix).removesuffix(_PICKLE): v for k, v in state.items()
                  if k.startswith(prefix)}
        group.update({k: v for k, v in values.pop("hparams", {}).items() if k in group})
        optimizer.state[p] = {  # type: ignore[union-attr]
            k: _like(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() else
            v.to(p.device) if isinstance(v, torch.Tensor) else v for k, v in values.items()
        }
    if rng in state:
        torch.set_rng_state(state[rng])
    return Loaded(step=state.get(f"meta.step{_PICKLE}", 0), extra=state.get(f"meta.extra{_PICKLE}"),
                  keys=tuple(sorted(keys)))


def load_into_model(model: torch.nn.Module, path: str | os.PathLike[str]) -> Loaded:
    """Load a pipeline checkpoint into the plain (unpipelined) model, in this process only.

    Needs no process group. Every entry of ``model.state_dict()`` must be in the checkpoint,
    under its own name or, for a tied weight, under one of its aliases.
    """
    path = Path(path)
    meta = _metadata(path)
    aliases: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        aliases.setdefault(id(t), []).append(name)
    targets: dict[str, torch.Tensor] = {}
    missing = []
    for name, t in model.state_dict(keep_vars=True).items():
        key = next((f"model.{a}" for a in aliases.get(id(t), [name]) if f"model.{a}" in meta), None)
        if key is None:
            missing.append(name)
        else:
            targets.setdefault(key, t)
    if missing:
        raise _missing_error(type(model).__name__, missing, path)
    extras = [k for k in (f"meta.step{_PICKLE}", f"meta.extra{_PICKLE}") if k in meta]
    state = _read(meta, [*targets, *extras], path, no_dist=True)
    with torch.no_grad():
        for key, t in targets.items():
            t.copy_(state[key])
    return Loaded(step=state.get(f"meta.step{_PICKLE}", 0), extra=state.get(f"meta.extra{_PICKLE}"),
                  keys=tuple(sorted(targets)))
