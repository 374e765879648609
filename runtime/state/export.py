"""Weights out in the Hugging Face format: ``pipe.save_pretrained(directory)``.

Every rank of the pipeline writes its stage's tensors, under the model's own names (the keys of
``pipe.state_dict()``), as one safetensors shard, and global rank 0 writes the index that
``from_pretrained`` and :func:`pipecut.runtime.state.weights.open_weights` read::

    model-00001-of-00002.safetensors     pipeline rank 0's tensors
    model-00002-of-00002.safetensors     pipeline rank 1's tensors
    model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {key: file}}
    config.json                          the model's config, when it has one

A tensor held by several stages (a tied weight, a chunked head's weight) is written once, by
the stage that owns it in checkpoints (:func:`pipecut.runtime.state.checkpoint.owned`), and under one
name: the one ``save_pretrained`` keeps (:func:`pipecut.runtime.state.pretrained.saved_name`; GPT-2's
``transformer.wte.weight``). Non-persistent buffers are not written, as in ``state_dict()``.
With data parallelism, FSDP's sharded parameters are gathered whole (``full_tensor()``, a
collective over the replicas) and only replica 0 writes; a shard is numbered among the ranks
that have something to write. Each file is written under a temporary name and renamed; the
index is written last, after every rank's shard is in place, and likewise renamed, so a reader
never sees an index naming a missing or partial shard. Shards of an earlier save that the new
index does not name (and a single ``model.safetensors``, which ``from_pretrained`` would prefer
to an index) are then removed.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipecut.errors import InputError, PipelineRuntimeError
from pipecut.runtime.state.checkpoint import owned
from pipecut.runtime.state.materialize import raise_together
from pipecut.runtime.state.pretrained import saved_name
from pipecut.runtime.state.weights import INDEX_FILE, SINGLE_FILE

if TYPE_CHECKING:  # Pipeline calls these modules: a run-time import would be a cycle
    from pipecut.runtime.pipeline import Pipeline

__all__ = ["export", "shard_name"]

_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_FORMAT = {"format": "pt"}  # safetensors metadata that from_pretrained checks


def shard_name(index: int, count: int) -> str:
    """The Hugging Face name of shard ``index`` (from 1) of ``count``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _keys(pipe: Pipeline) -> dict[str, tuple[list[str], torch.Tensor]]:
    """This rank's tensors by their first name in the model: (every state-dict key, tensor);
    tensors without a key (non-persistent buffers, lifted constants) left out."""
    names = pipe.captured.names
    out: dict[str, tuple[list[str], torch.Tensor]] = {}
    for m in pipe.modules:
        persistent = set(m.state_dict()) if names is None else set()
        for name, t in itertools.chain(m.named_parameters(remove_duplicate=False),
                                       m.named_buffers(remove_duplicate=False)):
            first = name if names is None else names.public(name)
            keys = ((name,) if name in persistent else ()) if names is None else names.state.get(name, ())
            if first is None or not keys:
                continue
            found = out.setdefault(first, ([], t))[0]
            found += [k for k in keys if k not in found]
    return out


def _replace(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename onto ``path``: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_shard(directory: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    _replace(directory / name, lambda tmp: save_file(tensors, str(tmp), metadata=_FORMAT))


def _write_index(directory: Path, weight_map: dict[str, str], total_size: int, config: Any,
                 model: torch.nn.Module | None) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _replace(directory / INDEX_FILE,
             lambda tmp: tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n"))
    if hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)  # the user's config is left as it is
        if model is not None:
            config.architectures = [type(model).__name__]
        config.save_pretrained(directory)
    shards = set(weight_map.values())
    for stale in directory.iterdir():
        if stale.name == SINGLE_FILE or (_SHARD.fullmatch(stale.name) and stale.name not in shards):
            stale.unlink()


def export(pipe: Pipeline, directory: str | os.PathLike[str], model: torch.nn.Module | None = None) -> Path:
    """Write the model's weights into ``directory`` in the Hugging Face format (see the module
    doc). Collective: call on every rank with the same ``directory`` (shared by the ranks that
    write). ``config.json`` is the config of the model compiled (kept at capture), or of
    ``model`` if given; ``model`` (the model given to compile, on meta or not) also sets the
    config's ``architectures`` and decides by its ``_tied_weights_keys`` which name of a tied
    weight is written (else the model's first name, the same for Hugging Face's models)."""
    directory = Path(directory)
    if (directory / ".metadata").exists():
        raise InputError(
            f"save_pretrained: {directory} holds a pipecut checkpoint (.metadata), which weight "
            f"readers would take instead of the safetensors; save into another directory"
        )
    # One writer per stage: replica 0's rank, and of its tensor group the first.
    writer = all(dist.get_rank(g) == 0 for g in (pipe.dp_group, pipe.tp_group) if g is not None)
    mine = owned(pipe)
    stage = {saved_name(keys, model): t for first, (keys, t) in sorted(_keys(pipe).items()) if first in mine}
    tensors: dict[str, torch.Tensor] = {}
    for key, t in sorted(stage.items()):  # the same order on every replica
        value = t.detach()
        if isinstance(value, DTensor):  # FSDP, tensor parallelism: gathered whole, a collective over its mesh
            value = value.full_tensor()
        if writer:  # the other ranks of the stage only take part in the gathers
            tensors[key] = value.cpu().contiguous()
    everyone: list[Any] = [None] * len(pipe.ranks)
    dist.all_gather_object(everyone, {k: t.numel() * t.element_size() for k, t in stage.items()},
                           group=pipe.group)
    writers = [r for r, sizes in enumerate(everyone) if sizes]
    files = {r: shard_name(i + 1, len(writers)) for i, r in enumerate(writers)}
    weight_map = {k: files[r] for r in writers for k in everyone[r]}
    if len(weight_map) != sum(len(s) for s in everyone):
        twice = sorted({k for a, b in itertools.combinations(everyone, 2) for k in set(a) & set(b)})
        raise PipelineRuntimeError(f"save_pretrained: tensors {twice[:5]} are owned by two stages")
    failure: BaseException | None = None
    try:
        if writer and tensors:
            _write_shard(directory, files[pipe.rank], tensors)
    except Exception as e:
        failure = e
    raise_together(failure, f"write its shard into {directory}")
    try:
        if writer and pipe.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            config = getattr(model, "config", None) or pipe.captured.config
            _write_index(directory, weight_map, sum(sum(s.values()) for s in everyone), config, model)
    except Exception as e:
        failure = e
    raise_together(failure, f"write the index of {directory}")
    return directory
