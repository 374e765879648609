"""Backward in two parts: input gradients now, weight gradients later (zero-bubble schedules).

The input-gradient pass (``I``) runs autograd only towards the stage's received inputs, so the
previous stage gets its gradients as early as possible. On the way, every autograd node that
lies on a path to the inputs *and* has a child leading only to parameters (a *frontier* node:
the matmul of a linear layer, whose child ``t()`` leads to the weight) has the gradient of its
output captured by a pre-hook. The weight pass (``W``) later re-enters the graph at those
frontier nodes with the captured gradients and asks only for the parameters below them, so each
product is computed once: ``dy·Wᵀ`` in ``I``, ``xᵀ·dy`` in ``W``. Subgraphs that reach no input
at all (the first stage) are left entirely to ``W``.
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


def _params_below(node: Node, accumulators: dict[Node, torch.Tensor], out: dict[int, torch.Tensor]) -> None:
    stack = [node]
    seen: set[Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in accumulators:
            p = accumulators[n]
            out[id(p)] = p
        stack += [child for child, _ in n.next_functions if child is not None]


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
        _accumulate(_weight_jobs(captured, roots, accumulators, reaches_input, reaches_param))
        # Drop every reference to the graph now, so its saved tensors go with this microbatch.
        captured.clear()
        roots.clear()
        reaches_input.clear()
        reaches_param.clear()

    return input_grads, weight_pass


_Root = tuple[Node, torch.Tensor, torch.Tensor]
"""An output that reaches no input: its autograd node, the output and its gradient."""
_Job = tuple[Sequence[Any], list[torch.Tensor], dict[int, torch.Tensor]]
"""Where the weight pass enters the graph, with which gradients, and the parameters below."""


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


def _weight_jobs(
    captured: dict[Node, tuple[torch.Tensor | None, ...]],
    roots: list[_Root],
    accumulators: dict[Node, torch.Tensor],
    reaches_input: _Reaches,
    reaches_param: _Reaches,
) -> list[_Job]:
    """One job per frontier node (its captured gradients, the parameters below its children
    that reach no input), and one for all the roots together."""
    jobs: list[_Job] = []
    for node, node_grads in captured.items():
        below: dict[int, torch.Tensor] = {}
        for child, _ in node.next_functions:
            if child is not None and not reaches_input(child) and reaches_param(child):
                _params_below(child, accumulators, below)
        edges = [(GradientEdge(node, i), g) for i, g in enumerate(node_grads) if g is not None]
        jobs.append(([e for e, _ in edges], [g for _, g in edges], below))
    if roots:
        below = {}
        for fn, _, _ in roots:
            _params_below(fn, accumulators, below)
        jobs.append(([o for _, o, _ in roots], [g for _, _, g in roots], below))
    return jobs


def _accumulate(jobs: list[_Job]) -> None:
    """Run each job's autograd and add the gradients into the parameters' ``.grad``."""
    for outs, outs_grads, below in jobs:
        targets = list(below.values())
        if not targets or not outs:
            continue
        found = torch.autograd.grad(outs, targets, outs_grads, retain_graph=True, allow_unused=True)
        for p, g in zip(targets, found):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
