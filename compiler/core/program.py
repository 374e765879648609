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

import torch
import torch.fx as fx

from pipecut.core.batching import check_inputs
from pipecut.core.kinds import CaptureMethod
from pipecut.core.names import ModelNames
from pipecut.core.torch_private import pytree
from pipecut.errors import InputError

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

    def flatten_inputs(self, inputs: Inputs, what: str = "inputs") -> list[Any]:
        """Map user inputs (a tuple of positionals or a dict of keywords) to placeholder values.
        ``what`` names the caller in errors ("step" for ``pipe.step``)."""
        check_inputs(inputs, what if what == "inputs" else f"{what} inputs")
        if self.method is CaptureMethod.EXPORT:
            return _flatten_for_export(inputs, self.in_spec, self.input_names, what)
        return _flatten_for_fx(inputs, self.input_names, self.defaults, what)

    def unflatten_output(self, flat: Any) -> Any:
        if self.out_spec is None:
            return flat
        return pytree.tree_unflatten(list(flat), self.out_spec)


class _NoDefault:
    def __repr__(self) -> str:
        return "<no default>"


NO_DEFAULT = _NoDefault()


def _flatten_for_fx(inputs: Inputs, names: Sequence[str], defaults: Sequence[Any], what: str) -> list[Any]:
    values: list[Any] = list(defaults)
    args, kwargs = split_args(inputs)

    def refused(why: str) -> InputError:
        return InputError(
            f"{what} got {_summary(args, kwargs)}; the plan was captured with "
            f"{_count(len(names), 'input')} ({', '.join(names)}), by position or keyword: {why}")

    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise refused(f"unknown input(s) {unknown}")
    if len(args) > len(names):
        raise refused(f"{len(args)} positional inputs, at most {len(names)}")
    values[: len(args)] = list(args)
    for i, name in enumerate(names):
        if name in kwargs:
            values[i] = kwargs[name]
    missing = [n for n, v in zip(names, values) if v is NO_DEFAULT]
    if missing:
        raise refused(f"no value for {missing}, which have no default")
    return values


def split_args(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return tuple(inputs), {}


def _flatten_for_export(inputs: Inputs, in_spec: pytree.TreeSpec | None, names: Sequence[str], what: str) -> list[Any]:
    args, kwargs = split_args(inputs)
    if in_spec is not None and kwargs:
        # pytree flattens dicts in insertion order: follow the order the graph was traced with.
        traced_keys = in_spec.child(1).context
        if set(traced_keys) == set(kwargs):
            kwargs = {k: kwargs[k] for k in traced_keys}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if in_spec is not None and spec != in_spec:
        raise InputError(
            f"{_mismatch(what, args, kwargs, in_spec, names)} (pytree structures: got {spec}, "
            f"captured {in_spec})"
        )
    return leaves


class _Label(str):
    """A leaf of the captured structure, shown by its placeholder's name."""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _render(value: Any) -> str:
    """A value's structure as a person reads it: tensors and names, in brackets and braces."""
    if isinstance(value, _Label):
        return str(value)
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_render(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_render(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def _summary(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    if not args and not kwargs:
        return "no inputs"
    parts = []
    if args:
        parts.append(f"{_count(len(args), 'positional input')} ({', '.join(_render(a) for a in args)})")
    if kwargs:
        shown = [k if isinstance(v, _Label) and v == k else f"{k}={_render(v)}" for k, v in kwargs.items()]
        parts.append(f"{_count(len(kwargs), 'keyword input')} ({', '.join(shown)})")
    return " and ".join(parts)


def _mismatch(what: str, args: Sequence[Any], kwargs: Mapping[str, Any], in_spec: pytree.TreeSpec,
              names: Sequence[str]) -> str:
    """What was passed, what the graph was captured with, and the first difference that
    matters, in words: positional against keyword, a count, keys, or one input's nesting."""
    labels = [_Label(n) for n in names] if len(names) == in_spec.num_leaves else [_Label("*")] * in_spec.num_leaves
    want_args, want_kwargs = pytree.tree_unflatten(labels, in_spec)
    head = f"{what} got {_summary(args, kwargs)}; the plan was captured with {_summary(want_args, want_kwargs)}"
    if args and not want_args:
        return f"{head}: pass them as keywords, a dict {{{', '.join(repr(k) for k in want_kwargs)}: ...}}"
    if kwargs and not want_kwargs:
        return f"{head}: pass them as positionals, a tuple ({', '.join(_render(a) for a in want_args)},)"
    if len(args) != len(want_args):
        return head
    if set(kwargs) != set(want_kwargs):
        unknown, missing = sorted(set(kwargs) - set(want_kwargs)), sorted(set(want_kwargs) - set(kwargs))
        return f"{head}: " + "; ".join(
            ([f"unknown input(s) {unknown}"] if unknown else []) + ([f"missing keyword(s) {missing}"] if missing else []))
    pairs = [(f"positional input {i}", a, w) for i, (a, w) in enumerate(zip(args, want_args))]
    pairs += [(f"keyword input {k!r}", kwargs[k], want_kwargs[k]) for k in want_kwargs]
    for where, got, want in pairs:
        if pytree.tree_structure(got) != pytree.tree_structure(want):
            shown = f"one value ({want})" if isinstance(want, _Label) else _render(want)
            return f"{head}: {where} is {_render(got)}, captured as {shown}"
    return head


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
