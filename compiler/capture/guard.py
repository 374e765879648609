"""Capture leaves the user's model as it was, and refuses state changes a graph cannot repeat.

Tracing runs the model's Python ``forward``. Whatever that code assigns lands on the user's
model: under ``symbolic_trace`` a buffer reassigned in forward (``self.calls += 1``) becomes an
fx ``Proxy`` on the model, and a plain counter (``self.steps += 1``) really counts. So
:class:`ModuleState` snapshots every module's attributes before an attempt and puts them back
after it, and says what the attempt changed:

- a parameter or buffer *reassigned*: the fx graph does not record the assignment (it only
  holds the computation, with no user), so the pipeline would silently skip it; capture then
  falls back to ``torch.export``, which records buffer mutation as an in-place ``copy_``;
- a number attribute changed (``int``/``float``/``bool``): no graph records Python state, so
  the plain model and the pipeline would drift apart; capture refuses it. (torch.export puts
  such attributes back itself, so only a symbolic_trace attempt, the default's first, sees it.)

:func:`check_input_writes` refuses a graph that writes into a model input: every stage gets its
own copy of the inputs, so a stage reading the input after another stage wrote it would not see
the write. It runs the graph once on fake tensors (no compute, no memory) and watches the
inputs' version counters, which also catches writes through views (``x[:, 0].zero_()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from pipecut.core.graph import mutates_first_arg
from pipecut.core.meta import META, to_meta
from pipecut.core.torch_private import FakeTensorMode, TorchDispatchMode
from pipecut.errors import CaptureError

__all__: list[str] = []

_SLOTS = ("_parameters", "_buffers")
_NUMBER = (int, float, bool)


@dataclass(frozen=True)
class _Saved:
    module: torch.nn.Module
    attrs: dict[str, Any]
    """The module's ``__dict__``, shallow."""
    contents: dict[str, Any]
    """Shallow copies of the dict, set and list attributes (``_parameters``, ``_buffers``, …)."""


class ModuleState:
    """Every module's attributes, to put back after tracing and to compare with what it left."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.paths = {id(m): path for path, m in model.named_modules(remove_duplicate=True)}
        self.saved = []
        for m in model.modules():
            copies = {k: _copy(v) for k, v in vars(m).items()}
            self.saved.append(_Saved(m, dict(vars(m)), {k: c for k, c in copies.items() if c is not None}))

    def restore(self) -> None:
        for s in self.saved:
            current = vars(s.module)
            for key in [k for k in current if k not in s.attrs]:
                del current[key]
            for key, value in s.attrs.items():
                if key in s.contents:
                    _refill(value, s.contents[key])
                current[key] = value

    def reassigned(self) -> list[str]:
        """Parameters and buffers the model now holds under another object than before."""
        out = []
        for s in self.saved:
            for slot in _SLOTS:
                before, now = s.contents.get(slot, {}), vars(s.module).get(slot, {})
                out += [_fqn(self.paths, s.module, k) for k in sorted(set(before) | set(now))
                        if before.get(k) is not now.get(k)]
        return out

    def changed_numbers(self) -> list[str]:
        """Number attributes whose value changed: 'path.name (old -> new)'."""
        out = []
        for s in self.saved:
            now = vars(s.module)
            for key, old in s.attrs.items():
                new = now.get(key, old)
                if isinstance(old, _NUMBER) and new is not old and new != old:
                    out.append(f"{_fqn(self.paths, s.module, key)} ({old!r} -> {new!r})")
        return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, set):
        return set(value)
    if isinstance(value, list):
        return list(value)
    return None


def _refill(container: Any, contents: Any) -> None:
    if isinstance(container, (dict, set)):
        container.clear()
        container.update(contents)
    elif isinstance(container, list):
        container[:] = contents


def _fqn(paths: dict[int, str], module: torch.nn.Module, name: str) -> str:
    path = paths.get(id(module), "")
    return f"{path}.{name}" if path else name


def refuse_number_changes(changed: Sequence[str], model: torch.nn.Module) -> None:
    if changed:
        raise CaptureError(
            f"{type(model).__name__}.forward changes the Python attribute(s) {changed[:5]}; a "
            f"captured graph cannot repeat that, so the pipelined model would drift from the "
            f"plain one. Keep such state in a tensor registered with register_buffer (its "
            f"update is then part of the graph), or update it outside forward"
        )


class _InputWritten(Exception):
    def __init__(self, node: fx.Node, name: str) -> None:
        self.node, self.name = node, name


class _Watch(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, inputs: Sequence[tuple[str, torch.Tensor]]) -> None:
        super().__init__(gm)
        self.inputs = list(inputs)
        self.versions = [t._version for _, t in self.inputs]

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        for (name, t), version in zip(self.inputs, self.versions):
            if t._version != version:
                raise _InputWritten(n, name)
        return out


class _Runner(torch.nn.Module):
    """Holds the graph so that ``functional_call`` can swap its state for fake tensors."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, watched: Sequence[tuple[str, torch.Tensor]], *values: Any) -> Any:
        return _Watch(self.gm, watched).run(*values)


def _swapped_run(
    gm: fx.GraphModule, names: Sequence[str], values: Sequence[Any],
    convert: Callable[[torch.Tensor], torch.Tensor], context: Any,
) -> tuple[fx.Node, str] | None:
    """The first node that writes into an input and that input's name, running the graph with
    every tensor (inputs, parameters, buffers, constants) converted, so nothing real is written."""
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    named = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    named += [(t, v) for t in sorted(targets) if isinstance(v := _attr(gm, t), torch.Tensor)]
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in named:  # one value per tensor: functional_call ties the aliases itself
        if id(t) not in seen:
            seen.add(id(t))
            state[f"gm.{name}"] = convert(t)
    with context:
        converted = [convert(v) if isinstance(v, torch.Tensor) else v for v in values]
        watched = [(n, c) for n, c in zip(names, converted) if isinstance(c, torch.Tensor)]
        try:
            with torch.no_grad():
                torch.func.functional_call(_Runner(gm), state, (watched, *converted))
        except _InputWritten as e:
            return e.node, e.name
    return None


class _OnMeta(TorchDispatchMode):
    """Every op that takes a device makes its tensor on meta, whichever device the graph names:
    a graph's own constants (``arange(..., device=cpu)`` building a causal mask of seq² entries)
    would otherwise be computed for real before they meet the meta inputs."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = list(args), dict(kwargs or {})
        for i, argument in enumerate(func._schema.arguments):
            if argument.name != "device":
                continue
            if argument.kwarg_only or i >= len(args):
                kwargs["device"] = META
            else:
                args[i] = META
        return func(*args, **kwargs)


def _first_write(gm: fx.GraphModule, names: Sequence[str], values: Sequence[Any]) -> tuple[fx.Node, str] | None:
    """On meta tensors (constants the graph makes included: :class:`_OnMeta`); where an op cannot
    run on them (a value-dependent op), on fake tensors (the first use in a process imports torch._dynamo:
    seconds and ~30 MiB that every rank would keep); where an op cannot run on those either,
    the in-place ops applied to an input itself (then writes through views are not seen).

    A run that fails part-way saw no write before the failing node (each node's writes are
    checked as it runs), so the next way starts afresh."""
    try:
        return _swapped_run(gm, names, values, to_meta, _OnMeta())
    except Exception:  # not the model's error: the fake-tensor run decides
        pass
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        return _swapped_run(gm, names, values, mode.from_tensor, mode)
    except Exception:
        return next(_direct_writes(gm), None)


def _attr(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part, None)  # type: ignore[assignment]
    return module


def _direct_writes(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, str]]:
    """Static fallback: in-place ops whose first argument is a placeholder itself."""
    for node in gm.graph.nodes:
        first = node.args[0] if node.args else None
        if isinstance(first, fx.Node) and first.op == "placeholder" and mutates_first_arg(node, gm):
            yield node, first.name


def check_input_writes(gm: fx.GraphModule, names: Sequence[str], values: Sequence[Any]) -> None:
    """CaptureError if the graph writes into one of its inputs (directly or through a view)."""
    found = _first_write(gm, names, values)
    if found is None:
        return
    node, name = found
    raise CaptureError(
        f"node {node.name!r} ({node.format_node()}) writes in place into the model input "
        f"{name!r}. Every pipeline stage gets its own copy of the inputs, so stages reading "
        f"{name!r} after the write would not see it. Write out of place instead "
        f"(e.g. `{name} = {name} * 2` rather than `{name}.mul_(2)`), or clone first "
        f"(`{name} = {name}.clone()`)"
    )
