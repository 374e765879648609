"""Backward in two parts: input gradients now, weight gradients later (zero-bubble schedules).

The input-gradient pass (``I``) runs autograd only towards the stage's received inputs, so the
previous stage gets its gradients as early as possible. On the way, every autograd node that
lies on a path to the inputs *and* has a child leading only to parameters (a *frontier* node:
the matmul of a linear layer, whose child ``t()`` leads to the weight) has the gradient of its
output captured by a pre-hook. The weight pass (``W``) later runs each frontier node again, for
its parameter-side children only, so each product is computed once: ``dy·Wᵀ`` in ``I``, ``xᵀ·dy``
in ``W``; then it runs the parameter-only part of the graph below those children in one go.
Subgraphs that reach no input at all (the first stage) are left entirely to ``W``.

Why in two steps, and not "re-enter at each frontier node and ask for the parameters below it":
a parameter is often reachable from a frontier node both through its parameter-side child and
through its input-side child (a layer shared by every layer as in ALBERT, a residual stream whose
first part reaches no input as in a T5 or BART decoder stage, a tied head). Autograd would then
walk the input side again and count the gradient of every earlier frontier node twice. So the
first step asks autograd only for the gradient on each parameter-side *edge* of a frontier node;
where such an edge's child has another parent, autograd could still reach it the long way, and
the node's backward function is called directly instead (it recomputes that node's input-side
gradients too: cheap for the nodes where this happens, an add or a norm, and always correct).

The weight pass ends in the parameters' own ``AccumulateGrad`` nodes (one
``torch.autograd.backward`` with ``inputs=``), so ``p.grad`` is made as in any backward (a fresh
tensor in the parameter's layout where autograd hands two parameters one tensor, as ``x + pos``
with one sample does), and hooks on the accumulators (DDP's reducer) fire as they would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["split_backward"]


class _Reaches:
    """``reaches(node)``: whether autograd ``node`` leads to one of ``targets``, memoised.

    A class, not a closure calling itself: such a closure is a reference cycle, and through its
    memo it would keep every node of the graph, with the tensors they saved for backward, alive
    until Python's cyclic collector happened to run (zero-bubble grew by a microbatch's
    activations per step, and re-faulted that memory in every forward). The walk is iterative,
    so a deep graph does not hit Python's recursion limit."""

    def __init__(self, targets: set[Node]) -> None:
        self.targets = targets
        self.memo: dict[Node, bool] = {}

    def __call__(self, node: Node | None) -> bool:
        if node is None:
            return False
        stack = [(node, False)]
        while stack:
            n, expanded = stack.pop()
            if n in self.memo and not expanded:
                continue
            children = [c for c, _ in n.next_functions if c is not None]
            if expanded:
                self.memo[n] = n in self.targets or any(self.memo.get(c, False) for c in children)
                continue
            if n in self.targets:
                self.memo[n] = True
                continue
            self.memo[n] = False  # the graph is a DAG; this only guards re-entry
            stack.append((n, True))
            stack += [(c, False) for c in children if c not in self.memo]
        return self.memo[node]

    def clear(self) -> None:
        self.memo.clear()


def split_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], Callable[[], None]]:
    """Input gradients of ``inputs`` now; a function that adds the weight gradients into
    ``p.grad`` for every ``p`` of ``params`` later (call it once)."""
    params = [p for p in params if p.requires_grad]
    accumulators = {get_gradient_edge(p).node: p for p in params}
    reaches_input = _Reaches({get_gradient_edge(t).node for t in inputs})
    reaches_param = _Reaches(set(accumulators))
    frontier, roots = _frontier(outputs, grads, reaches_input, reaches_param)
    input_grads, captured = _input_pass(outputs, grads, inputs, frontier)

    def weight_pass() -> None:
        seeds = _parameter_side_gradients(captured, reaches_input, reaches_param, _parents(outputs))
        _accumulate(seeds, roots, params)
        # Drop every reference to the graph now, so its saved tensors go with this microbatch.
        captured.clear()
        roots.clear()
        reaches_input.clear()
        reaches_param.clear()

    return input_grads, weight_pass


_Root = tuple[Node, torch.Tensor, torch.Tensor]
"""An output that reaches no input: its autograd node, the output and its gradient."""
_Edge = tuple[Node, int]
"""An edge of the autograd graph, as ``next_functions`` lists it: the child and its output index."""


def _frontier(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], reaches_input: _Reaches,
    reaches_param: _Reaches,
) -> tuple[list[Node], list[_Root]]:
    """The frontier nodes on the paths from ``outputs`` to the inputs, and the outputs that
    reach parameters but no input (left whole to the weight pass)."""
    frontier: list[Node] = []
    roots: list[_Root] = []
    seen: set[Node] = set()
    stack = []
    for out, grad in zip(outputs, grads):
        if out.grad_fn is None:
            continue
        if reaches_input(out.grad_fn):
            stack.append(out.grad_fn)
        elif reaches_param(out.grad_fn):
            roots.append((out.grad_fn, out, grad))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        children = [child for child, _ in node.next_functions if child is not None]
        if any(not reaches_input(c) and reaches_param(c) for c in children):
            frontier.append(node)
        stack += [c for c in children if reaches_input(c)]
    return frontier, roots


def _input_pass(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
    frontier: list[Node],
) -> tuple[list[torch.Tensor | None], dict[Node, tuple[torch.Tensor | None, ...]]]:
    """The inputs' gradients, and the gradient each frontier node's output got on the way."""
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    hooks = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, tuple(g))) for n in frontier]
    input_grads: list[torch.Tensor | None] = []
    try:
        if inputs:
            input_grads = list(torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True))
    finally:
        for h in hooks:
            h.remove()
    return input_grads, captured


def _parents(outputs: Sequence[torch.Tensor]) -> dict[Node, set[Node]]:
    """Each node of the graph below ``outputs`` with the nodes that have an edge into it."""
    parents: dict[Node, set[Node]] = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, set()).add(node)
                stack.append(child)
    return parents


def _parameter_side_gradients(
    captured: dict[Node, tuple[torch.Tensor | None, ...]], reaches_input: _Reaches,
    reaches_param: _Reaches, parents: dict[Node, set[Node]],
) -> dict[_Edge, torch.Tensor]:
    """The gradient on every edge from a frontier node to a child that reaches parameters and
    no input, summed where several frontier nodes feed one edge."""
    seeds: dict[_Edge, torch.Tensor] = {}
    for node, node_grads in captured.items():
        edges = list(dict.fromkeys(
            (c, nr) for c, nr in node.next_functions
            if c is not None and not reaches_input(c) and reaches_param(c)
        ))
        if all(parents.get(c, set()) <= {node} for c, _ in edges):
            flows = _edge_gradients(node, node_grads, edges)
        else:  # a child with another parent: autograd could reach it the long way round
            flows = _call_backward(node, node_grads, edges)
        for edge, g in zip(edges, flows):
            if g is not None:
                seeds[edge] = g if edge not in seeds else seeds[edge] + g
    return seeds


def _edge_gradients(node: Node, node_grads: tuple[torch.Tensor | None, ...],
                    edges: list[_Edge]) -> Sequence[torch.Tensor | None]:
    """Autograd from ``node``'s output gradients to ``edges``, each of whose child has ``node``
    as its only parent: only ``node`` runs, and only for those outputs."""
    given = [(GradientEdge(node, i), g) for i, g in enumerate(node_grads) if g is not None]
    if not given:
        return [None] * len(edges)
    return torch.autograd.grad([e for e, _ in given], [GradientEdge(c, nr) for c, nr in edges],
                               [g for _, g in given], retain_graph=True, allow_unused=True)


def _call_backward(node: Node, node_grads: tuple[torch.Tensor | None, ...],
                   edges: list[_Edge]) -> list[torch.Tensor | None]:
    """``node``'s backward function called directly: the gradient on every edge it has, of
    which those in ``edges`` are returned (an edge listed twice gets both parts)."""
    with torch.no_grad():
        if callable(node):  # a C++ node: undefined gradients may stay None
            out = node(*node_grads)
        else:  # a Python autograd.Function: it expects the zeros autograd would materialise
            grads = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                     for g, m in zip(node_grads, node._input_metadata)]  # type: ignore[attr-defined]
            out = node.apply(*grads)  # type: ignore[attr-defined]
    out = out if isinstance(out, tuple) else (out,)
    flows: dict[_Edge, torch.Tensor] = {}
    for (c, nr), g in zip(node.next_functions, out):
        if c is not None and g is not None:
            g = _as_expected(g, c._input_metadata[nr])  # type: ignore[attr-defined]
            flows[(c, nr)] = g if (c, nr) not in flows else flows[(c, nr)] + g
    return [flows.get(edge) for edge in edges]


def _as_expected(grad: torch.Tensor, meta: Any) -> torch.Tensor:
    """What autograd's engine makes of a gradient before passing it on (``validate_outputs``):
    summed down to the shape the child expects (a broadcast operand) and cast to its dtype."""
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    return grad.to(meta.dtype) if grad.dtype != meta.dtype else grad


def _accumulate(seeds: dict[_Edge, torch.Tensor], roots: list[_Root], params: Sequence[torch.Tensor]) -> None:
    """Run the parameter-only part of the graph from the seeded edges and the roots in one
    ``torch.autograd.backward`` towards ``params``: the parameters' ``AccumulateGrad`` nodes add
    into ``.grad`` and fire their hooks, so the gradient reductions of DDP (armed before a step's
    last weight pass, :mod:`pipecut.runtime.grads.data_parallel`) start bucket by bucket while
    this pass still runs, as they do in an ordinary backward. A seeded edge whose child is a
    parameter's accumulator (a parameter used directly by a frontier node) is a root of its own."""
    outs: list[Any] = [GradientEdge(child, nr) for child, nr in seeds]
    outs_grads = list(seeds.values())
    outs += [out for _, out, _ in roots]
    outs_grads += [g for _, _, g in roots]
    if outs:
        torch.autograd.backward(outs, outs_grads, inputs=list(params))
