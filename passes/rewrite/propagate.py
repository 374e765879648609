"""Shapes, dtypes and size constants of every node for given input shapes and autocast state.

The plan records each cut value as profiled: planned input shapes, no autocast. Under
``torch.autocast`` a cut tensor may be bf16 instead of fp32, and with a shorter sequence or a
smaller microbatch both the tensors and the sizes crossing a cut (``x.size(1)``) change. Rather
than asking the sending rank (a runtime handshake, which can hang), every rank runs the captured
graph it already holds on *fake* tensors (``FakeTensorMode``: shapes and dtypes, no data, no
compute) for the microbatch's input shapes under the same autocast state, and reads each node's
output. Every rank computes the same answer from the same inputs, so sender and receiver agree
without exchanging a byte. The result is cached per :class:`~pipecut.core.shapes.Signature` by the
caller.

Parameters and buffers are replaced by fake tensors of their shape and dtype on the target
device (``torch.func.functional_call``), so propagation works whatever device the real ones
are on (another stage's weights may be on the CPU, or on ``meta``). The captured graph is not
modified: nothing is written into ``node.meta``.

    >>> values = propagate(captured.gm, [torch.empty(2, 40, dtype=torch.long)],
    ...                    device=torch.device("cpu"), autocast=AutocastState("cpu", True, "bfloat16"))
    >>> values["blocks_0_qkv"].dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from pipecut.core.cut_values import describe, dtype_from_name, dtype_name
from pipecut.core.kinds import CaptureMethod
from pipecut.core.shapes import AutocastState
from pipecut.core.torch_private import FakeTensorMode, quiet_fake_tensors
from pipecut.ir import InputShape, NodeCost, Plan

__all__ = ["PropagationError", "accepted_shapes", "cut_values", "propagate"]


class PropagationError(RuntimeError):
    """A node of the graph cannot run on fake tensors of the given shapes (a shape mismatch, or
    an op whose output shape depends on data)."""


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps every node's output (fx.Interpreter frees them as it goes)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            value = super().run_node(n)
        except Exception as e:
            raise PropagationError(
                f"node {n.name} ({n.op} {n.target}): {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            ) from e
        self.values[n.name] = value
        return value


class _Run(torch.nn.Module):
    """Holds the graph as a submodule so functional_call can swap in fake parameters."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Any) -> dict[str, Any]:
        recorder = _Recorder(self.gm)
        recorder.run(*args)
        return recorder.values


def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return fake.requires_grad_(t.requires_grad)


def propagate(
    gm: fx.GraphModule, inputs: Sequence[Any], *, device: torch.device, autocast: AutocastState
) -> dict[str, Any]:
    """Node name -> output (fake tensors, and real Python values for sizes and constants) of
    ``gm`` run on tensors shaped like ``inputs`` (real or fake; non-tensors pass as they are)
    on ``device`` under ``autocast``. Raises :class:`PropagationError` naming the failing node."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    amp: contextlib.AbstractContextManager[Any] = (
        torch.autocast(autocast.device_type, dtype=dtype_from_name(autocast.dtype))
        if autocast.enabled
        else contextlib.nullcontext()
    )
    with mode:
        args = [_fake_like(x, device) if isinstance(x, torch.Tensor) else x for x in inputs]
        state = {name: _fake_like(t, device) for name, t in _state(gm)}
    # Grad mode on, as in training and profiling: requires_grad of a cut value is part of its spec.
    try:
        with mode, amp, torch.enable_grad(), quiet_fake_tensors():
            values: dict[str, Any] = torch.func.functional_call(
                _Run(gm), state, tuple(args), strict=False, tie_weights=True
            )
    except PropagationError as e:  # fx appends "While executing ..." lines: keep the first
        raise PropagationError(str(e).splitlines()[0]) from e.__cause__
    return values


def _state(gm: fx.GraphModule) -> Iterable[tuple[str, torch.Tensor]]:
    for name, p in gm.named_parameters():
        yield f"gm.{name}", p
    for name, b in gm.named_buffers():
        yield f"gm.{name}", b


def cut_values(
    gm: fx.GraphModule, plan: Plan, inputs: Sequence[Any], *, device: torch.device, autocast: AutocastState
) -> dict[str, NodeCost]:
    """Every value crossing a cut, as the plan's row with leaves (shapes, dtypes, size
    constants) and structure as they are for ``inputs`` under ``autocast``."""
    values = propagate(gm, inputs, device=device, autocast=autocast)
    names = dict.fromkeys(n for s in plan.stages for n in (*s.inputs, *s.outputs))
    out = {}
    for name in names:
        if name not in values:
            raise PropagationError(f"cut value {name} is not a node of the captured graph; re-plan")
        leaves, treespec = describe(values[name])
        out[name] = dataclasses.replace(plan.node(name), leaves=leaves, treespec=treespec)
    return out


def accepted_shapes(
    gm: fx.GraphModule, method: CaptureMethod, names: Sequence[str], inputs: Sequence[Any]
) -> tuple[InputShape, ...]:
    """The per-microbatch shapes each tensor input may take without re-planning.

    The planned shape (``inputs``, one microbatch) is the maximum of every dimension. With
    torch.export the graph is only valid where export's symbolic shapes say so: a dimension
    export kept symbolic ranges from its lower bound (export assumes sizes of at least 2) to
    the planned size, and inputs sharing a symbol must agree; every other dimension is fixed.
    symbolic_trace re-runs the model's own Python op by op, so on any shape it propagates it
    computes what the plain model computes: ranges only decide which errors come early.
    They are found by probing (see :func:`_probe_ranges`); a shape in range that still fails
    is refused at run time by the same propagation.
    """
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    probed = _probe_ranges(gm, inputs) if method is not CaptureMethod.EXPORT else {}
    out = []
    for i, (name, value) in enumerate(zip(names, inputs)):
        if not isinstance(value, torch.Tensor):
            continue
        shape = tuple(value.shape)
        if method is CaptureMethod.EXPORT:
            lo, symbols = _export_ranges(by_name[name], shape)
        else:
            ranges = [probed.get((i, d), (size, "")) for d, size in enumerate(shape)]
            lo, symbols = tuple(r[0] for r in ranges), tuple(r[1] for r in ranges)
            symbols = symbols if any(symbols) else ()
        out.append(InputShape(name=name, dtype=dtype_name(value.dtype), min_shape=lo, max_shape=shape,
                              symbols=symbols))
    return tuple(out)


def _probe_ranges(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[tuple[int, int], tuple[int, str]]:
    """(input, dim) -> (lowest accepted size, symbol) for symbolic_trace graphs.

    Dimension 0 of every input is the batch (always equal across inputs): it is shrunk on all
    at once. Other dimensions are grouped by planned size (a sequence length shared by
    ``input_ids`` and ``attention_mask``) and shrunk together; a group that propagates one
    smaller accepts sizes from 1. Its members must stay equal (a shared symbol) unless each
    also propagates shrunk alone. Dimensions of size 1 stay fixed.
    """
    groups: dict[str, list[tuple[int, int]]] = {}
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            for d, size in enumerate(x.shape):
                if size > 1:
                    groups.setdefault("batch" if d == 0 else f"size{size}", []).append((i, d))
    out: dict[tuple[int, int], tuple[int, str]] = {}
    for key, members in groups.items():
        if not _shrinks(gm, inputs, members):
            continue
        independent = key == "batch" or len(members) == 1 or all(_shrinks(gm, inputs, [m]) for m in members)
        for m in members:
            out[m] = (1, "" if independent else key)
    return out


def _shrinks(gm: fx.GraphModule, inputs: Sequence[Any], dims: Sequence[tuple[int, int]]) -> bool:
    """Whether the graph propagates with each of ``dims`` (input, dim) one smaller."""
    shapes = {i: list(x.shape) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)}
    for i, d in dims:
        shapes[i][d] -= 1
    probe = [
        torch.empty(shapes[i], dtype=x.dtype, device="meta") if i in shapes else x for i, x in enumerate(inputs)
    ]
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    try:
        propagate(gm, probe, device=device, autocast=AutocastState("", False, ""))
    except PropagationError:
        return False
    return True


def _export_ranges(node: fx.Node, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return shape, ()
    lo, symbols = [], []
    for d, size in zip(val.shape, shape):
        if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
            ranges = d.node.shape_env.var_to_range.get(d.node.expr)
            lower = int(ranges.lower) if ranges is not None and ranges.lower.is_finite else 2
            lo.append(min(max(lower, 1), size))
            symbols.append(str(d.node.expr))
        else:
            lo.append(size)
            symbols.append("")
    return tuple(lo), tuple(symbols)
