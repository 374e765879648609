"""Capture a model as a torch.fx graph: ``symbolic_trace`` first, ``torch.export`` second.

``symbolic_trace`` keeps modules as ``call_module`` nodes and the user's own parameter objects;
it fails on data-dependent Python control flow (most Hugging Face models). ``torch.export``
(non-strict) traces through such code at the ATen level; its *unlifted* module holds the same
parameter objects under their original names as ``get_attr`` nodes. Either way the result is a
:class:`Captured`: a GraphModule plus how to flatten user inputs into its placeholders and how
to rebuild the model's output structure.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from pipecut.batching import check_inputs
from pipecut.errors import CaptureError, InputError
from pipecut.fxutil import target_name
from pipecut.meta import has_meta, input_device, relocate_meta, to_meta
from pipecut.plan import CaptureMethod

Inputs = tuple[Any, ...] | Mapping[str, Any]


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
    """For symbolic_trace: each placeholder's default value (``_NO_DEFAULT`` if none)."""

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


_NO_DEFAULT = _NoDefault()


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
    missing = [n for n, v in zip(names, values) if v is _NO_DEFAULT]
    if missing:
        raise InputError(f"input(s) {missing} missing; the model takes {list(names)}")
    return values


def _split_args(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return tuple(inputs), {}


def _flatten_for_export(inputs: Inputs, in_spec: pytree.TreeSpec | None) -> list[Any]:
    args, kwargs = _split_args(inputs)
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


def _trace_fx(model: torch.nn.Module, leaf_modules: tuple[type, ...]) -> fx.GraphModule:
    class Tracer(fx.Tracer):
        proxy_buffer_attributes = True  # buffers become get_attr nodes, sliceable by traced sizes

        def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
            return isinstance(m, leaf_modules) or super().is_leaf_module(m, qualname)

    tracer = Tracer()
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, model.__class__.__name__)


def capture(
    model: torch.nn.Module,
    example_inputs: Inputs,
    *,
    method: CaptureMethod | None = None,
    leaf_modules: tuple[type, ...] = (),
) -> Captured:
    """Capture ``model``; try symbolic_trace, then torch.export, unless ``method`` forces one."""
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_inputs(example_inputs, "example_inputs")
    attempts: list[str] = []
    if method in (None, CaptureMethod.SYMBOLIC_TRACE):
        try:
            gm = _trace_fx(model, leaf_modules)
            names, defaults = [], []
            for n in gm.graph.nodes:
                if n.op == "placeholder":
                    names.append(n.name)
                    defaults.append(n.args[0] if n.args else _NO_DEFAULT)
            captured = Captured(gm, CaptureMethod.SYMBOLIC_TRACE, tuple(names), None, None, tuple(defaults))
            captured.flatten_inputs(example_inputs)  # reject inputs the traced signature can't take
            return captured
        except InputError:
            raise
        except Exception as e:
            attempts.append(f"torch.fx.symbolic_trace: {type(e).__name__}: {_first_line(e)}")
    if method in (None, CaptureMethod.EXPORT):
        try:
            args, kwargs = _split_args(example_inputs)
            on_meta = has_meta(model)  # a meta model traces with meta inputs (see pipecut.meta)
            if on_meta:
                args, kwargs = to_meta((args, kwargs))
            ep = torch.export.export(model, args, kwargs, strict=False)
            gm = ep.module()
            if on_meta:
                relocate_meta(gm, input_device(example_inputs))
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            return Captured(
                gm,
                CaptureMethod.EXPORT,
                tuple(names),
                ep.call_spec.in_spec,
                ep.call_spec.out_spec,
                (),
            )
        except Exception as e:
            attempts.append(f"torch.export.export(strict=False): {type(e).__name__}: {_first_line(e)}")
    raise CaptureError(
        f"could not capture {type(model).__name__} as a graph.\n  "
        + "\n  ".join(attempts)
        + "\nWhat you can do: pass leaf_modules=(TheFailingModule,) so symbolic_trace keeps it "
        "opaque; for Hugging Face models pass use_cache=False / return_dict in the config and "
        "give every input the model needs as a keyword tensor; make data-dependent control "
        "flow depend on shapes or config values instead of tensor values."
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def fingerprint(gm: fx.GraphModule) -> str:
    """Hash of the graph's structure and parameter shapes: equal for the same model code/config."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
        text = re.sub(r"0x[0-9a-f]+", "0x?", f"{node.op}|{node.name}|{target_name(node)}|{args!r}")
        h.update(text.encode() + b"\n")
    for name, p in gm.named_parameters(remove_duplicate=False):
        h.update(f"P|{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
    for name, b in gm.named_buffers(remove_duplicate=False):
        h.update(f"B|{name}|{tuple(b.shape)}|{b.dtype}\n".encode())
    return h.hexdigest()[:16]
