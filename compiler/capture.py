"""Capture a model as a torch.fx graph: ``symbolic_trace`` first, ``torch.export`` second.

``symbolic_trace`` keeps modules as ``call_module`` nodes and the user's own parameter objects;
it fails on data-dependent Python control flow (most Hugging Face models). ``torch.export``
(non-strict) traces through such code at the ATen level; its *unlifted* module holds the same
parameter objects under their original names as ``get_attr`` nodes. Either way the result is a
:class:`Captured`: a GraphModule plus how to flatten user inputs into its placeholders and how
to rebuild the model's output structure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from pipecut.batching import check_inputs
from pipecut.errors import CaptureError, InputError
from pipecut.frozen import honour_no_grad, record_grad_mode
from pipecut.fxutil import target_name
from pipecut.guard import ModuleState, check_input_writes, refuse_number_changes
from pipecut.meta import has_meta, input_device, relocate_meta, to_meta
from pipecut.names import ModelNames, model_names
from pipecut.plan import CaptureMethod

__all__ = ["Captured", "Inputs", "capture", "fingerprint"]

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
    names: ModelNames | None = None
    """The user's model's names for the graph's tensors (None: the graph's own names)."""

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

        def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
            # fx does not see grad-mode changes: note them, so no_grad blocks can be honoured.
            return record_grad_mode(super().create_node(*args, **kwargs))

    tracer = Tracer()
    with torch.enable_grad():  # grad disabled while tracing can then only come from forward
        graph = honour_no_grad(tracer.trace(model))
    return fx.GraphModule(tracer.root, graph, model.__class__.__name__)


def capture(
    model: torch.nn.Module,
    example_inputs: Inputs,
    *,
    method: CaptureMethod | None = None,
    leaf_modules: tuple[type, ...] = (),
) -> Captured:
    """Capture ``model``; try symbolic_trace, then torch.export, unless ``method`` forces one.

    The model is left as it was (see :mod:`pipecut.guard`); a model that writes into its
    inputs, or changes Python number attributes in forward, is refused with a CaptureError.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_inputs(example_inputs, "example_inputs")
    captured = _capture(model, example_inputs, method, leaf_modules)
    check_input_writes(captured.gm, captured.input_names, captured.flatten_inputs(example_inputs))
    return dataclasses.replace(captured, names=model_names(captured.gm, model))


def _untouched(model: torch.nn.Module, trace: Callable[[], fx.GraphModule]) -> tuple[fx.GraphModule, list[str]]:
    """Run one capture attempt and put the model back as it was; the graph and the parameters or
    buffers the attempt reassigned. An attempt that changed a number attribute is refused, even
    if it failed later on: forward changes it either way."""
    state = ModuleState(model)
    try:
        gm = trace()
    finally:
        changed, reassigned = state.changed_numbers(), state.reassigned()
        state.restore()
        refuse_number_changes(changed, model)
    return gm, reassigned


def _capture(
    model: torch.nn.Module,
    example_inputs: Inputs,
    method: CaptureMethod | None,
    leaf_modules: tuple[type, ...],
) -> Captured:
    attempts: list[str] = []
    if method in (None, CaptureMethod.SYMBOLIC_TRACE):
        try:
            gm, reassigned = _untouched(model, lambda: _trace_fx(model, leaf_modules))
            if reassigned:
                raise RuntimeError(
                    f"forward reassigns {reassigned[:5]}, which a symbolic_trace graph does not "
                    f"record (torch.export records buffer updates)"
                )
            names, defaults = [], []
            for n in gm.graph.nodes:
                if n.op == "placeholder":
                    names.append(n.name)
                    defaults.append(n.args[0] if n.args else _NO_DEFAULT)
            captured = Captured(gm, CaptureMethod.SYMBOLIC_TRACE, tuple(names), None, None, tuple(defaults))
            captured.flatten_inputs(example_inputs)  # reject inputs the traced signature can't take
            return captured
        except (InputError, CaptureError):
            raise
        except Exception as e:
            attempts.append(f"torch.fx.symbolic_trace: {type(e).__name__}: {_first_line(e)}")
    if method in (None, CaptureMethod.EXPORT):
        try:
            args, kwargs = _split_args(example_inputs)
            on_meta = has_meta(model)  # a meta model traces with meta inputs (see pipecut.meta)
            if on_meta:
                args, kwargs = to_meta((args, kwargs))
            exported: list[torch.export.ExportedProgram] = []
            gm, _ = _untouched(model, lambda: _export(model, args, kwargs, exported))
            ep = exported[0]
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
        except CaptureError:
            raise
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


def _export(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
    out: list[torch.export.ExportedProgram],
) -> fx.GraphModule:
    """torch.export with every tensor dimension left to export to keep symbolic where the model
    allows (``Dim.AUTO``), so one graph serves shorter sequences and smaller microbatches
    (``pipecut.passes.propagate.accepted_shapes`` reads which dimensions stayed symbolic).
    Where that fails, the shape-specialised export, whose plans accept only the planned shapes.
    The ExportedProgram is appended to ``out``."""
    # Fresh copies: an example that is a view (tokens[:, :-1]) makes export guard on its
    # ``_base``, which other inputs do not have.
    args, kwargs = pytree.tree_map(
        lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, (args, kwargs)
    )
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        auto = torch.export.Dim.AUTO
        dynamic = {
            name: pytree.tree_map(
                lambda x: {d: auto for d in range(x.dim())} if isinstance(x, torch.Tensor) else None, value
            )
            for name, value in bound.items()
        }
        ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic)
    except Exception:
        ep = torch.export.export(model, args, kwargs, strict=False)
    out.append(ep)
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    return gm


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
