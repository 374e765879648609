"""Recompute that a split backward runs once: a checkpoint whose recomputed tensors stay.

``torch.utils.checkpoint`` (non-reentrant) recomputes a checkpointed run once per *autograd
call* that unpacks one of its saved tensors, and keys what it recomputed by that call. A
zero-bubble schedule's backward of one microbatch is several calls: the input pass, then the
weight pass (an autograd call per frontier node, and one for the parameter-only rest; see
:mod:`pipecut.runtime.execution.backward_split`). A recomputing stage under it would run its
forward again in each of them.

:func:`held_checkpoint` keeps only the run's inputs in the forward, as torch's checkpoint does.
The first unpack, in whichever call, runs the forward again once (the RNG and autocast state
as the forward had them) and keeps every tensor the run saves, for every later unpack in any
call, until the autograd graph that holds the run is freed: after the weight pass. Between the
two passes it keeps all of the run's saved tensors: those the weight pass reads (the inputs of
each weight's product) and those only the input pass read, which torch's own checkpoint would
have freed during that pass. The microbatch then holds what a stage without recompute holds
between its passes; the saving is between its forward and its input pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from pipecut.core.torch_private import pytree
from pipecut.errors import PipelineRuntimeError

__all__ = ["held_checkpoint"]


class _Run:
    """One checkpointed call: its function and inputs, the state to recompute it under, and
    what the recompute saved (None until the first unpack)."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any]) -> None:
        self.fn = fn
        self.args = tuple(args)
        tensors = [a for a in pytree.tree_leaves(self.args) if isinstance(a, torch.Tensor)]
        self.cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda]
        self.autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                         if torch.is_autocast_enabled(kind)]
        self.count = 0
        self.values: list[torch.Tensor] | None = None

    def pack(self, _: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.values is None:
            self.values = self._recompute()
        return self.values[index]

    def _recompute(self) -> list[torch.Tensor]:
        values: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> None:
            values.append(t.detach() if t.requires_grad else t)

        with torch.random.fork_rng(devices=self.cuda):  # the CPU's, and those of the CUDA devices listed
            torch.set_rng_state(self.cpu_rng)
            for d, state in zip(self.cuda, self.cuda_rng):
                torch.cuda.set_rng_state(state, d)
            with torch.enable_grad(), saved_tensors_hooks(keep, _never), _autocast(self.autocast):
                self.fn(*self.args)
        if len(values) != self.count:
            raise PipelineRuntimeError(
                f"a recomputed forward saved {len(values)} tensors for backward where the forward saved "
                f"{self.count}: the stage does not compute the same thing twice (data-dependent control "
                f"flow?); plan it without recompute (PartitionOptions(recompute='none'))")
        return values


def _never(_: None) -> torch.Tensor:
    raise PipelineRuntimeError("a tensor saved while recomputing was read back: recompute nested in a recompute")


def _autocast(states: Sequence[tuple[str, torch.dtype]]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for kind, dtype in states:
        stack.enter_context(torch.autocast(kind, dtype=dtype))
    return stack


def held_checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, keeping only ``args`` for backward and recomputing the rest once, at the
    first unpack of any autograd call (see the module's docstring)."""
    run = _Run(fn, args)
    with saved_tensors_hooks(run.pack, run.unpack):
        return fn(*args)
