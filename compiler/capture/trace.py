"""Capture a model as a torch.fx graph: ``symbolic_trace`` first, ``torch.export`` second.

``symbolic_trace`` keeps modules as ``call_module`` nodes and the user's own parameter objects;
it fails on data-dependent Python control flow (most Hugging Face models). ``torch.export``
(non-strict) traces through such code at the ATen level; its *unlifted* module holds the same
parameter objects under their original names as ``get_attr`` nodes. Either way the result is a
:class:`~pipecut.core.program.Captured`: a GraphModule plus how to flatten user inputs into its placeholders and how
to rebuild the model's output structure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import logging
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.fx as fx

from pipecut.capture.bound import Expired, check_unchanged, time_bound, torch_state
from pipecut.capture.frozen import honour_no_grad, record_grad_mode
from pipecut.capture.guard import ModuleState, check_input_writes, refuse_number_changes
from pipecut.core.batching import check_inputs
from pipecut.core.choices import enum_choice
from pipecut.core.graph import target_name
from pipecut.core.kinds import CaptureMethod
from pipecut.core.meta import has_meta, input_device, relocate_meta, to_meta
from pipecut.core.names import model_names
from pipecut.core.program import NO_DEFAULT, Captured, Inputs, Shapes, split_args
from pipecut.core.torch_private import pytree
from pipecut.errors import CaptureError, InputError
from pipecut.options import AUTO, EXPORT_TIME_LIMIT, CaptureOptions, leaf_name, limit_seconds

__all__ = ["capture", "capture_as", "fingerprint"]

log = logging.getLogger(__name__)

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
    method: CaptureMethod | Literal["auto"] = AUTO,
    leaf_modules: Sequence[type | str] = (),
    dynamic_shapes: bool = True,
    time_limit: float | Literal["unbounded"] = EXPORT_TIME_LIMIT,
) -> Captured:
    """Capture ``model``; try symbolic_trace, then torch.export ("auto"), unless ``method`` forces one.
    ``leaf_modules``: module classes (or their ``module.QualName``) symbolic_trace keeps whole.
    ``dynamic_shapes``/``time_limit``: how torch.export treats shapes, and for how long it may
    reason about symbolic ones before exporting at static shapes instead (see
    :class:`~pipecut.options.CaptureOptions`; the result's ``static_shapes`` says which).

    The model is left as it was (see :mod:`pipecut.capture.guard`); a model that writes into its
    inputs, or changes Python number attributes in forward, is refused with a CaptureError.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_inputs(example_inputs, "example_inputs")
    if method != AUTO:
        method = enum_choice(CaptureMethod, method, "capture method", auto=True)
    shapes = _Shapes(dynamic_shapes, limit_seconds(time_limit))
    captured = _capture(model, example_inputs, method, leaf_modules, shapes)
    check_input_writes(captured.gm, captured.input_names, captured.flatten_inputs(example_inputs))
    return dataclasses.replace(captured, names=model_names(captured.gm, model),
                               config=getattr(model, "config", None))


def capture_as(model: torch.nn.Module, example_inputs: Inputs, options: CaptureOptions,
               method: CaptureMethod | Literal["auto"] | None = None) -> Captured:
    """:func:`capture` as ``options`` say; ``method``, where given, instead of theirs (a replayed
    plan's)."""
    return capture(model, example_inputs, method=options.method if method is None else method,
                   leaf_modules=options.leaf_modules, dynamic_shapes=options.dynamic_shapes,
                   time_limit=options.time_limit)


@dataclasses.dataclass(frozen=True, slots=True)
class _Shapes:
    """How torch.export is asked to treat shapes (the capture options' two fields)."""

    dynamic: bool
    time_limit: float
    """Seconds; ``math.inf`` where the options say "unbounded"."""


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
    method: CaptureMethod | Literal["auto"],
    leaf_modules: Sequence[type | str],
    shapes: _Shapes,
) -> Captured:
    attempts: list[str] = []
    if method in (AUTO, CaptureMethod.SYMBOLIC_TRACE):
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
    if method in (AUTO, CaptureMethod.EXPORT):
        try:
            args, kwargs = split_args(example_inputs)
            on_meta = has_meta(model)  # a meta model traces with meta inputs (see pipecut.core.meta)
            if on_meta:
                args, kwargs = to_meta((args, kwargs))
            exported: list[tuple[torch.export.ExportedProgram, Shapes]] = []
            with _without_kv_cache(model):
                gm, _ = _untouched(model, lambda: _export(model, args, kwargs, shapes, exported))
            ep, kept = exported[0]
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
                shapes=kept,
            )
        except CaptureError:
            raise
        except Exception as e:
            attempts.append(f"torch.export.export(strict=False): {type(e).__name__}: {_first_line(e)}")
    raise CaptureError(
        f"could not capture {type(model).__name__} as a graph.\n  "
        + "\n  ".join(attempts)
        + "\nWhat you can do: pass leaf_modules=(TheFailingModule,) so symbolic_trace keeps it "
        "opaque; for Hugging Face models pass return_dict in the config and "
        "give every input the model needs as a keyword tensor; make data-dependent control "
        "flow depend on shapes or config values instead of tensor values."
    )


@contextlib.contextmanager
def _without_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """A transformers model whose config asks for a key/value cache (``use_cache=True``, the
    default of its causal LMs, which a user who builds one from a config gets) is exported
    without it: a training step never reads the cache, and its ``DynamicCache`` output is no
    tensor tree torch.export can return. The config is put back on the way out, so the user's
    model is as it was; the graph returns what the model returns with ``use_cache=False``
    (``past_key_values`` None). An input that passes ``use_cache`` itself decides."""
    configs: dict[int, Any] = {}
    for m in model.modules():  # an encoder-decoder's decoder holds a config of its own
        config = getattr(m, "config", None)
        if getattr(config, "use_cache", None) is True:
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def _export(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], shapes: _Shapes,
    out: list[tuple[torch.export.ExportedProgram, Shapes]],
) -> fx.GraphModule:
    """torch.export with every tensor dimension left to export to keep symbolic where the model
    allows (``Dim.AUTO``), so one graph serves shorter sequences and smaller microbatches
    (``pipecut.passes.rewrite.propagate.accepted_shapes`` reads which dimensions stayed symbolic).
    Where that fails, or runs past ``shapes.time_limit``, or ``shapes.dynamic`` is False: the
    shape-specialised export, whose plans accept only the planned shapes. The ExportedProgram
    is appended to ``out``, with which of the two it is."""
    ep, kept = _export_symbolic(model, *_fresh(args, kwargs), shapes) if shapes.dynamic else (None, Shapes.STATIC)
    if ep is None:
        ep = torch.export.export(model, *_fresh(args, kwargs), strict=False)
    out.append((ep, kept))
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    return gm


def _fresh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh copies of the example for one export attempt: an example that is a view
    (tokens[:, :-1]) makes export guard on its ``_base``, which other inputs do not have, and
    an attempt that fails or is interrupted leaves its dynamic-dimension marks on the tensors
    it was given (a later static export would then trace them symbolically)."""
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))


def _export_symbolic(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], shapes: _Shapes,
) -> tuple[torch.export.ExportedProgram | None, Shapes]:
    """torch.export with every dimension ``Dim.AUTO``, within the time limit; no program where
    it fails or runs out of time (logged, and said by the :class:`Shapes`), for the caller to
    export at static shapes."""
    name = type(model).__name__
    before, start = torch_state(), time.monotonic()
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        auto = torch.export.Dim.AUTO
        dynamic = {
            arg: pytree.tree_map(lambda x: {d: auto for d in range(x.dim())} if isinstance(x, torch.Tensor) else None,
                                 value)
            for arg, value in bound.items()
        }
        with time_bound(shapes.time_limit) as timer:
            if shapes.time_limit < math.inf and not timer.armed:
                log.warning(
                    "capturing %s: torch.export with symbolic shapes runs without its %g s bound here "
                    "(capture is not on the main thread, where SIGALRM can interrupt it); call plan/"
                    "compile from the main thread, or pass CaptureOptions(dynamic_shapes=False)",
                    name, shapes.time_limit)
            log.info("capturing %s with torch.export (symbolic shapes%s)", name,
                     f", at most {shapes.time_limit:g} s" if timer.armed else "")
            ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic)
        log.info("captured %s with symbolic shapes in %.1f s", name, time.monotonic() - start)
        return ep, Shapes.SYMBOLIC
    except Expired:
        check_unchanged(before, name)
        log.warning(
            "capturing %s: torch.export with symbolic shapes ran past %g s (CaptureOptions.time_limit); "
            "exporting at the example's shapes instead: the plan accepts only the planned shapes "
            "(CaptureOptions(dynamic_shapes=False) skips the wait; time_limit='unbounded' waits for it)",
            name, shapes.time_limit)
        return None, Shapes.TIMED_OUT
    except Exception as e:
        log.info("capturing %s: torch.export with symbolic shapes failed after %.1f s (%s: %s); "
                 "exporting at the example's shapes", name, time.monotonic() - start, type(e).__name__,
                 _first_line(e))
        return None, Shapes.STATIC


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
