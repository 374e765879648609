"""Where a stage's weights come from: safetensors, a ``save_pretrained`` directory, a pipecut
checkpoint or a state dict, read tensor by tensor so that a rank reads only its stage's.

``open_weights`` accepts:

- a ``.safetensors`` file;
- a directory written by Hugging Face ``save_pretrained``: ``model.safetensors``, or shards
  listed in ``model.safetensors.index.json`` (its ``weight_map`` says which file holds which
  tensor), or otherwise every ``*.safetensors`` file in it;
- a pipecut checkpoint directory (``pipecut.runtime.state.checkpoint.save``, DCP with ``.metadata``):
  its ``model.<fqn>`` entries;
- a mapping from names to tensors (a state dict).

safetensors files are opened with ``safe_open`` and read one tensor at a time (``get_tensor``),
memory-mapped, so reading a stage costs that stage's bytes, not the file's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipecut.errors import InputError

__all__: list[str] = []

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

Weights = str | os.PathLike[str] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class WeightSource:
    """Names of the tensors a source holds, where each lives, and how to read some of them."""

    description: str
    files: Mapping[str, str] = field(default_factory=dict)
    """Tensor name -> file (safetensors) or directory (checkpoint) holding it."""
    tensors: Mapping[str, torch.Tensor] | None = None
    """For a state dict: the tensors themselves."""
    dcp: Path | None = None

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self.tensors if self.tensors is not None else self.files)

    def where(self, key: str) -> str:
        return self.files.get(key, self.description)

    def read(self, keys: Sequence[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for each of ``keys``, one at a time, so that the caller can copy each
        into place and drop it (on ``device`` for safetensors; as stored otherwise)."""
        if self.tensors is not None:
            yield from ((k, self.tensors[k]) for k in keys)
            return
        if self.dcp is not None:
            from pipecut.runtime.state.checkpoint import _metadata, _read

            state = _read(_metadata(self.dcp), [f"model.{k}" for k in keys], self.dcp, no_dist=True)
            yield from ((k, state.pop(f"model.{k}")) for k in keys)
            return
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        where = "cpu" if device.type == "cpu" else str(device)
        for path, names in by_file.items():
            with safe_open(path, framework="pt", device=where) as f:
                for k in names:
                    yield k, f.get_tensor(k)


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:
        raise InputError(f"weights: cannot read {path} as safetensors: {e}") from e


def _files(paths: Sequence[Path]) -> dict[str, str]:
    return {k: str(p) for p in paths for k in _safetensors_keys(p)}


def _directory(path: Path) -> WeightSource:
    if (path / ".metadata").exists():
        from pipecut.runtime.state.checkpoint import _metadata

        keys = [k.removeprefix("model.") for k in _metadata(path) if k.startswith("model.")]
        return WeightSource(f"checkpoint {path}", files=dict.fromkeys(keys, str(path)), dcp=path)
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise InputError(f"weights: {index} has no 'weight_map'; is it a safetensors index?")
        return WeightSource(str(path), files={k: str(path / f) for k, f in weight_map.items()})
    if (path / SINGLE_FILE).exists():
        return WeightSource(str(path), files=_files([path / SINGLE_FILE]))
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return WeightSource(str(path), files=_files(shards))
    found = sorted(p.name for p in path.iterdir())[:10]
    raise InputError(
        f"weights: {path} holds no safetensors files and is not a pipecut checkpoint (it has "
        f"{found}); save with save_pretrained(..., safe_serialization=True) or convert "
        f"pytorch_model.bin to safetensors"
    )


def open_weights(weights: Weights) -> WeightSource:
    """A :class:`WeightSource` for a file, a directory or a state dict (see the module doc)."""
    if isinstance(weights, Mapping):
        bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise InputError(f"weights: state dict entries {bad[:5]} are not tensors")
        return WeightSource("the state dict passed as weights", tensors=dict(weights))
    if not isinstance(weights, (str, os.PathLike)):
        raise InputError(
            f"weights must be a path (.safetensors file, save_pretrained or checkpoint "
            f"directory) or a state dict, got {type(weights).__name__}"
        )
    path = Path(weights)
    if path.is_dir():
        return _directory(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise InputError(
                f"weights: {path} is not a .safetensors file; pass a .safetensors file, a "
                f"save_pretrained or pipecut checkpoint directory, or a state dict"
            )
        return WeightSource(str(path), files=_files([path]))
    raise InputError(f"weights: {path} does not exist")
