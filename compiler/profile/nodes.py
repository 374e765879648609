"""Measure every node of a captured graph on one microbatch: time, output and parameter bytes.

Each node is run on its real inputs (interpreting the graph once, in order). Forward time is the
median of up to ``repeats`` runs after ``warmup`` (fewer once the samples agree: see
:class:`~pipecut.core.clock.Timer`); backward time is the median of
``torch.autograd.grad`` of the node's output with respect to its floating inputs and parameters,
taken on detached copies so that no ``.grad`` is touched. Profiling leaves the model as it was:
buffers (BatchNorm statistics) and the RNG state are saved and restored, parameters are never
written, and gradients are computed with ``autograd.grad`` instead of ``backward``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable, Sequence
from functools import partial
from typing import Any

import torch
import torch.fx as fx

from pipecut.capture.frozen import inside_no_grad
from pipecut.core.clock import Timer
from pipecut.core.cut_values import describe, tensor_bytes
from pipecut.core.graph import (
    canonical_names,
    module_path,
    mutates_first_arg,
    node_parameters,
    target_name,
)
from pipecut.core.kinds import NodeOp
from pipecut.core.meta import elsewhere, input_device, read_by, scratch, substitute, to_meta
from pipecut.core.program import Captured
from pipecut.core.torch_private import pytree
from pipecut.ir import NodeCost
from pipecut.profile.flops import NodeWork
from pipecut.profile.oversized import estimate_oversized, is_out_of_memory, meta_work, stand_in
from pipecut.profile.running import (
    LossFn,
    NodeRunner,
    check_loss,
    cut,
    detached_leaves,
    preserved_state,
)
from pipecut.profile.saved import SavedBytes
from pipecut.profile.signature import cost_key

__all__ = ["LossFn", "node_row", "profile"]

STEADY = 0.1
"""Sampling stops early once three or more samples lie within this fraction of their median:
more would not move the median, and the large ops that dominate profiling time are the steady
ones. Noisy (mostly tiny) ops get every repeat."""


def _forward_ms(
    runner: NodeRunner, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any],
    inplace: bool, timer: Timer,
) -> float:
    if not inplace:
        return timer.ms(lambda: runner.call(node, args, kwargs))

    def run_on_copies() -> Any:  # repeats must not compound an in-place write
        a, k = pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        with torch.no_grad():
            return runner.call(node, a, k)

    return timer.ms(run_on_copies)


def _backward_ms(
    runner: NodeRunner, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any],
    params: Sequence[torch.Tensor], inplace: bool, timer: Timer,
) -> float:
    """Gradient computation plus the accumulation of parameter gradients into ``.grad``
    (training adds every microbatch's weight gradient into it)."""
    (args2, kwargs2), leaves = detached_leaves((args, kwargs), clone=inplace)
    out = runner.call(node, args2, kwargs2)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = leaves + [p for p in params if p.requires_grad]
    if not outs or not wrt:
        return 0.0
    grads = [torch.ones_like(t) for t in outs]

    def backward() -> Any:
        return torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True)

    compute_ms, grads_out = timer.sampled(backward)
    originals = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.requires_grad]
    is_param = [isinstance(x, torch.nn.Parameter) for x in originals] + [True] * (len(wrt) - len(leaves))
    weight_grads = [g for g, p in zip(grads_out, is_param) if p and g is not None]
    if not weight_grads:
        return compute_ms
    sums = [torch.zeros_like(g) for g in weight_grads]

    def accumulate() -> None:
        for acc, g in zip(sums, weight_grads):
            acc.add_(g)

    return compute_ms + timer.ms(accumulate)


def _time_loss(loss_fn: LossFn, output: Any, target: Any, timer: Timer) -> tuple[float, float]:
    def detach(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return x.detach().requires_grad_(True)
        return x

    output = pytree.tree_map(detach, output)
    forward_ms = timer.ms(lambda: loss_fn(output, target))
    loss = check_loss(loss_fn(output, target))
    wrt = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wrt or not loss.requires_grad:
        return forward_ms, 0.0
    backward_ms = timer.ms(lambda: torch.autograd.grad(loss, wrt, retain_graph=True, allow_unused=True))
    return forward_ms, backward_ms


def profile(
    captured: Captured,
    inputs: Sequence[Any],
    *,
    loss_fn: LossFn | None = None,
    target: Any = None,
    repeats: int = 5,
    warmup: int = 2,
    progress: Callable[[int, int], None] | None = None,
    reuse: bool = True,
    device: torch.device | str | None = None,
    only: Collection[str] | None = None,
) -> tuple[NodeCost, ...]:
    """Cost table of ``captured`` on flat placeholder ``inputs`` (one microbatch).

    ``reuse``: measure each distinct op-on-shapes once and give its times to every node with
    the same :func:`~pipecut.profile.signature.cost_key` (the N blocks of a transformer are
    measured once, not N times); False measures every node.
    ``device``: where to measure (None: where ``inputs`` are). Elsewhere, the inputs and target
    are copied there, and each node's weights only while it is measured, so a model left on
    the CPU is timed on the GPU its stages will run on without ever being there whole.
    ``only``: time just these nodes (the rest run once, for their values, and get zero times;
    the loss is not timed unless ``"output"`` is named): a graph rewritten in a few places is
    measured where it changed (see :mod:`pipecut.planning.heavy`)."""
    device = torch.device(device) if device is not None else input_device(inputs)
    timer = Timer(repeats, warmup, device, steady=STEADY)  # CUDA events on a GPU
    inputs, target = _placed((inputs, target), device)
    walk = _Walk(captured, device, timer, loss_fn=loss_fn, target=target, reuse=reuse, only=only)
    nodes = list(captured.gm.graph.nodes)
    last_use = {n: i for i, node in enumerate(nodes) for n in node.all_input_nodes}
    placeholders = iter(inputs)
    with preserved_state(captured.gm), torch.enable_grad():
        for i, node in enumerate(nodes):
            walk.visit(node, next(placeholders) if node.op == "placeholder" else None)
            for n in node.all_input_nodes:  # free values no later node reads
                if last_use[n] == i and n.op != "output":
                    walk.env.pop(n, None)
            if progress is not None:
                progress(i + 1, len(nodes))
        return walk.table()


class _Walk:
    """One pass over a graph: each node run (and timed) on the values before it, its row kept."""

    def __init__(self, captured: Captured, device: torch.device, timer: Timer, *, loss_fn: LossFn | None,
                 target: Any, reuse: bool, only: Collection[str] | None) -> None:
        self.captured, self.gm, self.device, self.timer = captured, captured.gm, device, timer
        self.loss_fn, self.target, self.reuse, self.only = loss_fn, target, reuse, only
        self.canonical = canonical_names(self.gm)
        self.runner = NodeRunner(self.gm)
        self.env: dict[fx.Node, Any] = {}
        self.rows: list[NodeCost] = []
        self.measured: dict[Hashable, tuple[float, float]] = {}  # by cost key: each op-on-shapes once
        self.metas: dict[fx.Node, Any] = {}
        self.oversized: dict[str, NodeWork] = {}
        self.saved = SavedBytes([*self.gm.parameters(), *self.gm.buffers()])

    def visit(self, node: fx.Node, placeholder: Any) -> None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self.env[n])
        times = (0.0, 0.0)
        if node.op == "placeholder":
            value = placeholder
            self.saved.produced(None, value)
        elif node.op == "output":
            value = args[0]
            times = self._loss(node, value)
        elif node.op == "get_attr":
            value = self.runner.call(node, args, kwargs)
            self.saved.constant(value)
        else:
            self.metas[node] = to_meta((args, kwargs))  # for estimates, if any are needed
            value, times = self._operation(node, args, kwargs)
        self.env[node] = value
        self.rows.append(node_row(node, value, self.gm, self.canonical, *times))

    def _loss(self, node: fx.Node, value: Any) -> tuple[float, float]:
        if self.loss_fn is None:
            return 0.0, 0.0
        output = self.captured.unflatten_output(value)
        times = (0.0, 0.0)
        if self.only is None or node.name in self.only:
            times = _time_loss(self.loss_fn, output, self.target, self.timer)
        self.saved.run(node.name, value, partial(self.loss_fn, output, self.target))  # what the loss keeps
        return times

    def _operation(self, node: fx.Node, args: Any, kwargs: Any) -> tuple[Any, tuple[float, float]]:
        """Run and time an operation; one too big for the device gets a stand-in value and is
        estimated later from the others' rates."""
        try:
            # A meta model's weights (or weights on another device) are here only while their node is measured.
            with scratch(self.gm, read_by(node, self.gm, (args, kwargs)), self.device) as real:
                args, kwargs = substitute((args, kwargs), real)
                times = self._timed(node, args, kwargs)
                value = self.saved.run(node.name, (args, kwargs), partial(self.runner.call, node, args, kwargs),
                                       exclude=real.values())
                if real:  # cut the autograd graph: it would keep the scratch weights alive
                    value = pytree.tree_map(cut, value)
                return value, times
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            margs, mkwargs = self.metas[node]
            value, self.oversized[node.name] = stand_in(self.runner, node, self.gm, margs, mkwargs, self.device)
            return value, (0.0, 0.0)  # estimated in table(), from the measured nodes' rates

    def _timed(self, node: fx.Node, args: Any, kwargs: Any) -> tuple[float, float]:
        if self.only is not None and node.name not in self.only:
            return 0.0, 0.0  # run for its value only
        inplace = mutates_first_arg(node, self.gm)
        key = cost_key(node, self.gm, args, kwargs, inplace) if self.reuse else None
        if key is not None and key in self.measured:
            return self.measured[key]
        forward_ms = _forward_ms(self.runner, node, args, kwargs, inplace, self.timer)
        params = [p for _, p in node_parameters(node, self.gm)]
        times = (forward_ms, _backward_ms(self.runner, node, args, kwargs, params, inplace, self.timer))
        if key is not None:
            self.measured[key] = times
        return times

    def table(self) -> tuple[NodeCost, ...]:
        """The rows with what autograd keeps per node (the loss's on the output row; estimated
        rows keep their whole output: nothing measured), oversized nodes priced at the rates
        the others ran at."""
        rows = [dataclasses.replace(r, saved_bytes=self.saved.bytes_of(r.name))
                if r.op is not NodeOp.GET_ATTR and r.name not in self.oversized else r for r in self.rows]
        if not self.oversized:
            return tuple(rows)
        work = {n.name: meta_work(self.runner, n, self.gm, a, k)[1]
                for n, (a, k) in self.metas.items() if n.name not in self.oversized}
        return estimate_oversized(rows, work, self.oversized)


def _placed(values: Any, device: torch.device) -> Any:
    """``values`` with every tensor not on ``device`` copied there (meta ones stay meta)."""
    return pytree.tree_map(
        lambda x: x.to(device) if elsewhere(x, device) and x.device.type != "meta" else x, values
    )


def node_row(
    node: fx.Node, value: Any, gm: fx.GraphModule, canonical: dict[int, str],
    forward_ms: float, backward_ms: float,
) -> NodeCost:
    params = node_parameters(node, gm)
    unique = {id(p): p for _, p in params}
    leaves, treespec = ((), None) if node.op == "output" else describe(value)
    first = next((leaf for leaf in leaves if leaf.shape or leaf.dtype), None)
    return NodeCost(
        name=node.name,
        op=NodeOp(node.op),
        target=target_name(node) if node.op != "output" else "output+loss",
        module=module_path(node),
        inputs=tuple(n.name for n in node.all_input_nodes),
        forward_ms=forward_ms,
        backward_ms=backward_ms,
        output_bytes=0 if node.op in ("output", "get_attr") else tensor_bytes(value),
        param_bytes=sum(p.numel() * p.element_size() for p in unique.values()),
        parameters=tuple(dict.fromkeys(canonical[id(p)] for _, p in params if id(p) in canonical)),
        shape=first.shape if first is not None else None,
        dtype=first.dtype if first is not None else None,
        leaves=leaves,
        treespec=treespec,
        cuttable=not inside_no_grad(node),
    )
