"""Running a captured graph one node at a time, as profiling and work counting do.

The interpreter that runs a single node on explicit arguments, fresh autograd leaves for a
node's inputs, values cut from their history, and the guard that leaves a model's buffers and
the RNG as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from pipecut.core.torch_private import pytree
from pipecut.errors import InputError

__all__ = ["LossFn", "NodeRunner", "check_loss", "cut", "detached_leaves", "preserved_state"]

LossFn = Callable[[Any, Any], torch.Tensor]


def check_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a scalar tensor; else the InputError that says how to reduce it."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(
            f"loss_fn must return a scalar tensor, got {got}; reduce it (e.g. .mean(), or "
            f"reduction='mean') so that the step's loss is the mean over the batch"
        )
    return loss


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Restore buffers and RNG state on exit: running a model must not change it."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


class NodeRunner(fx.Interpreter):
    """Runs single nodes with explicit args (fx.Interpreter dispatches per opcode)."""

    def call(self, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(self, node.op)(node.target, args, kwargs)


def detached_leaves(tree: Any, clone: bool = False) -> tuple[Any, list[torch.Tensor]]:
    """``tree`` with fresh autograd leaves for its tensors that require grad (copies if the
    node writes into its inputs), and those leaves."""
    leaves: list[torch.Tensor] = []

    def swap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            leaf = x.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone() if clone else leaf
        if isinstance(x, torch.Tensor) and clone:
            return x.clone()
        return x

    return pytree.tree_map(swap, tree), leaves


def cut(x: Any) -> Any:
    """``x`` without its autograd history; still requiring grad (and not a leaf, so that a later
    in-place node may write into it) when it did."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.requires_grad:
        return x.detach().requires_grad_(True).clone()
    return x.detach()
