"""Capture a model as a torch.fx graph: ``symbolic_trace`` first, ``torch.export`` second.

``symbolic_trace`` keeps modules as ``call_module`` nodes and the user's own parameter objects;
it fails on data-dependent Python control flow (most Hugging Face models). ``torch.export``
(non-strict) traces through such code at the ATen level; its *unlifted* module holds the same
parameter objects under their original names as ``get_attr`` nodes. Either way the result is a
:class:`~pipecut.core.program.Captured`: a GraphModule plus how to flatten user inputs into its placeholders and how
to rebuild the model's output structure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from pipecut.capture.frozen import honour_no_grad, record_grad_mode
from pipecut.capture.guard import ModuleState, check_input_writes, refuse_number_changes
from pipecut.core.batching import check_inputs
from pipecut.core.graph import target_name
from pipecut.core.meta import has_meta, input_device, relocate_meta, to_meta
from pipecut.core.names import model_names
from pipecut.core.program import NO_DEFAULT, Captured, Inputs, split_args
from pipecut.errors import CaptureError, InputError
from pipecut.options import leaf_name
from pipecut.plan import CaptureMethod

__all__ = ["capture", "fingerprint"]

def _trace_fx(model: torch.nn.Module, leaf_modules: Sequence[type | str]) -> fx.GraphModule:
    leaves = {leaf_name(c) for c in leaf_modules}

    class Tracer(fx.Tracer):
        proxy_buffer_attributes = True  # buffers become get_attr nodes, sliceable by traced sizes

        def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
            # By class name (the plan records names), subclasses included, as isinstance would.
            is_leaf = any(leaf_name(c) in leaves for c in type(m).__mro__)
            return is_leaf or super().is_leaf_module(m, qualname)

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
    leaf_modules: Sequence[type | str] = (),
) -> Captured:
    """Capture ``model``; try symbolic_trace, then torch.export, unless ``method`` forces one.
    ``leaf_modules``: module classes (or their ``module.QualName``) symbolic_trace keeps whole.

    The model is left as it was (see :mod:`pipecut.capture.guard`); a model that writes into its
    inputs, or changes Python number attributes in forward, is refused with a CaptureError.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_inputs(example_inputs, "example_inputs")
    captured = _capture(model, example_inputs, method, leaf_modules)
    check_input_writes(captured.gm, captured.input_names, captured.flatten_inputs(example_inputs))
    return dataclasses.replace(captured, names=model_names(captured.gm, model),
                               config=getattr(model, "config", None))


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
    leaf_modules: Sequence[type | str],
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
                    defaults.append(n.args[0] if n.args else NO_DEFAULT)
            captured = Captured(gm, CaptureMethod.SYMBOLIC_TRACE, tuple(names), None, None, tuple(defaults))
            captured.flatten_inputs(example_inputs)  # reject inputs the traced signature can't take
            return captured
        except (InputError, CaptureError):
            raise
        except Exception as e:
            attempts.append(f"torch.fx.symbolic_trace: {type(e).__name__}: {_first_line(e)}")
    if method in (None, CaptureMethod.EXPORT):
        try:
            args, kwargs = split_args(example_inputs)
            on_meta = has_meta(model)  # a meta model traces with meta inputs (see pipecut.core.meta)
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
    (``pipecut.passes.rewrite.propagate.accepted_shapes`` reads which dimensions stayed symbolic).
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
