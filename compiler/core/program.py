"""Programs: a captured model's graph with its input conventions, and one stage's program.

:class:`Captured` is what capture produces (a GraphModule, how user inputs flatten into its
placeholders and how its outputs rebuild the model's output); :class:`StageProgram` is what
:func:`pipecut.passes.rewrite.split.split` produces for each stage. Both are data the runtime executes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from pipecut.core.batching import check_inputs
from pipecut.core.names import ModelNames
from pipecut.errors import InputError
from pipecut.plan import CaptureMethod

__all__ = ["NO_DEFAULT", "Captured", "Inputs", "Shapes", "StageProgram", "split_args"]

Inputs = tuple[Any, ...] | Mapping[str, Any]


class Shapes(enum.Enum):
    """How a captured graph treats the shapes of its inputs (see :mod:`pipecut.capture.trace`)."""

    SYMBOLIC = "symbolic"
    """symbolic_trace (shape-free), or torch.export with every dimension ``Dim.AUTO``: the
    dimensions export kept symbolic take other sizes."""
    STATIC = "static"
    """torch.export at the example's shapes: asked (``CaptureOptions(dynamic_shapes=False)``),
    or the symbolic-shape export failed."""
    TIMED_OUT = "timed out"
    """torch.export at the example's shapes because the symbolic-shape export ran past
    ``CaptureOptions.time_limit``."""


@dataclass(frozen=True)
class Captured:
    """A captured model: its graph and the input/output conventions of that graph."""

    gm: fx.GraphModule
    method: CaptureMethod
    input_names: tuple[str, ...]
    """Placeholder names, in graph order."""
    in_spec: pytree.TreeSpec | None
    """For export: the pytree structure of ``(args, kwargs)`` the graph was traced with."""
    out_spec: pytree.TreeSpec | None
    """For export: how to rebuild the model's output from the graph's flat outputs."""
    defaults: tuple[Any, ...]
    """For symbolic_trace: each placeholder's default value (``NO_DEFAULT`` if none)."""
    names: ModelNames | None = None
    """The user's model's names for the graph's tensors (None: the graph's own names)."""
    config: Any = None
    """The user's model's ``config`` (a Hugging Face model's), for ``pipe.save_pretrained``'s
    ``config.json``; None if it has none."""
    shapes: Shapes = Shapes.SYMBOLIC
    """For export: whether the graph kept symbolic dimensions, or why it did not."""

    @property
    def static_shapes(self) -> bool:
        """An export graph traced at the example's shapes only: the plan accepts just those."""
        return self.shapes is not Shapes.SYMBOLIC

    def flatten_inputs(self, inputs: Inputs) -> list[Any]:
        """Map user inputs (a tuple of positionals or a dict of keywords) to placeholder values."""
        check_inputs(inputs)
        if self.method is CaptureMethod.EXPORT:
            return _flatten_for_export(inputs, self.in_spec)
        return _flatten_for_fx(inputs, self.input_names, self.defaults)

    def unflatten_output(self, flat: Any) -> Any:
        if self.out_spec is None:
            return flat
        return pytree.tree_unflatten(list(flat), self.out_spec)


class _NoDefault:
    def __repr__(self) -> str:
        return "<no default>"


NO_DEFAULT = _NoDefault()


def _flatten_for_fx(inputs: Inputs, names: Sequence[str], defaults: Sequence[Any]) -> list[Any]:
    values: list[Any] = list(defaults)
    if isinstance(inputs, Mapping):
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise InputError(f"unknown input(s) {unknown}; the model takes {list(names)}")
        for i, name in enumerate(names):
            if name in inputs:
                values[i] = inputs[name]
    else:
        if len(inputs) > len(names):
            raise InputError(f"{len(inputs)} positional inputs but the model takes {list(names)}")
        values[: len(inputs)] = list(inputs)
    missing = [n for n, v in zip(names, values) if v is NO_DEFAULT]
    if missing:
        raise InputError(f"input(s) {missing} missing; the model takes {list(names)}")
    return values


def split_args(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return tuple(inputs), {}


def _flatten_for_export(inputs: Inputs, in_spec: pytree.TreeSpec | None) -> list[Any]:
    args, kwargs = split_args(inputs)
    if in_spec is not None and kwargs:
        # pytree flattens dicts in insertion order: follow the order the graph was traced with.
        traced_keys = in_spec.child(1).context
        if set(traced_keys) != set(kwargs):
            raise InputError(f"inputs have keys {sorted(kwargs)}, the plan has {sorted(traced_keys)}")
        kwargs = {k: kwargs[k] for k in traced_keys}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if in_spec is not None and spec != in_spec:
        raise InputError(f"inputs are structured as {spec}, the captured graph expects {in_spec}")
    return leaves


@dataclass(frozen=True)
class StageProgram:
    index: int
    module: fx.GraphModule
    received: tuple[str, ...]
    """Values received from the previous stage, in wire order (first placeholders)."""
    model_inputs: tuple[str, ...]
    """Model input placeholders this stage reads (after the received ones)."""
    sent: tuple[str, ...]
    """Values sent to the next stage, in wire order (the module's outputs, unless last)."""
    is_last: bool
