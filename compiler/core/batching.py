"""Split a batch into microbatches along dimension 0.

Every tensor input (and every tensor in the target) must have the batch as its first
dimension; non-tensor values are given to every microbatch unchanged. The batch must split into
equal microbatches: then the mean of the microbatch losses is the full batch's mean loss and the
gradients equal those of the unsplit model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipecut.core.torch_private import pytree
from pipecut.errors import InputError

__all__ = ["batch_size", "check_inputs", "first_microbatch", "split_by_sizes", "split_microbatches"]


def check_inputs(inputs: Any, what: str = "inputs") -> None:
    """Inputs are a tuple (or list) of positional values or a dict of keyword values."""
    if not isinstance(inputs, (tuple, list, Mapping)):
        raise InputError(
            f"{what} must be a tuple of positional tensors or a dict of keyword tensors, "
            f"got {type(inputs).__name__}; wrap a single tensor as (x,)"
        )


def first_microbatch(example_inputs: Any, microbatches: int) -> tuple[int, Any]:
    """(batch size, the first microbatch in the inputs' own structure)."""
    check_inputs(example_inputs, "example_inputs")
    values = list(example_inputs.values()) if isinstance(example_inputs, Mapping) else example_inputs
    size = batch_size(values)
    return size, split_microbatches(example_inputs, microbatches, size)[0]


def batch_size(values: Sequence[Any]) -> int:
    sizes = {
        t.shape[0] for t in pytree.tree_leaves(list(values)) if isinstance(t, torch.Tensor) and t.dim() > 0
    }
    if not sizes:
        raise InputError("no tensor with a batch dimension among the inputs")
    if len(sizes) > 1:
        raise InputError(
            f"inputs disagree on the batch size (first dimension): {sorted(sizes)}; pipecut "
            f"splits every tensor input along dimension 0"
        )
    return sizes.pop()


def split_microbatches(value: Any, microbatches: int, size: int, what: str = "inputs") -> list[Any]:
    """``microbatches`` copies of ``value`` with every batched tensor cut into equal chunks."""
    if microbatches < 1:
        raise InputError(f"microbatches must be at least 1, got {microbatches}")
    if size % microbatches:
        raise InputError(
            f"a batch of {size} does not split into {microbatches} equal microbatches; "
            f"use a batch size that is a multiple of {microbatches} or change microbatches"
        )
    return split_by_sizes(value, [size // microbatches] * microbatches, what)


def split_by_sizes(value: Any, sizes: Sequence[int], what: str = "inputs") -> list[Any]:
    """``len(sizes)`` copies of ``value`` with every batched tensor cut along dimension 0."""
    total = sum(sizes)
    leaves, spec = pytree.tree_flatten(value)
    chunks: list[list[Any]] = [[] for _ in sizes]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] != total:
                raise InputError(
                    f"{what}: a tensor of shape {tuple(leaf.shape)} does not have the batch "
                    f"size {total} as its first dimension"
                )
            for i, part in enumerate(leaf.split(list(sizes))):
                chunks[i].append(part)
        else:
            for c in chunks:
                c.append(leaf)
    return [pytree.tree_unflatten(c, spec) for c in chunks]
