"""``torch.no_grad()`` inside ``forward``, for graphs from ``torch.fx.symbolic_trace``.

torch.fx records operations, not the grad mode they ran under, so a ``with torch.no_grad():``
block in ``forward`` is lost: the frozen layer inside it would get gradients and train. (The
export path needs nothing: ``torch.export`` records the block as one
``wrap_with_set_grad_enabled`` node.) The tracer therefore notes ``torch.is_grad_enabled()`` on
every node it creates (:func:`record_grad_mode`), and :func:`honour_no_grad` rewrites the graph
so that no gradient can pass through a node created with grad disabled: every tensor entering
such a node and every value it produces goes through :func:`detach_tree`.

This gives exactly the values and gradients of the eager block. Under ``no_grad`` an operation
records no history, so nothing upstream of it receives gradient through it, and its outputs do
not require grad; detaching its inputs and outputs gives the same. In-place writes inside the
block (an EMA update of a buffer, a clamp of a weight) act on the detached alias, which shares
storage and version counter with the original, as under ``no_grad``. The only difference is
cost: the node builds a small autograd record that is dropped at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from pipecut.core.torch_private import pytree

__all__: list[str] = []

GRAD_ENABLED = "pipecut_grad_enabled"
"""``node.meta`` key: whether grad mode was enabled when the tracer created the node."""


def record_grad_mode(node: fx.Node) -> fx.Node:
    """Note the current grad mode on a node the tracer has just created."""
    node.meta[GRAD_ENABLED] = torch.is_grad_enabled()
    return node


def detach_tree(value: Any) -> Any:
    """``value`` with every tensor leaf detached (non-tensors, containers kept as they are)."""
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


def no_grad_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Nodes the tracer created with grad disabled (placeholders and the output excluded)."""
    return [
        n for n in graph.nodes
        if n.op not in ("placeholder", "output") and n.meta.get(GRAD_ENABLED) is False
    ]


def inside_no_grad(node: fx.Node) -> bool:
    """A node of a no_grad block whose value still needs the block's closing detach: the
    partitioner must not cut between them (see ``NodeCost.cuttable``)."""
    return node.meta.get(GRAD_ENABLED) is False and node.target is not detach_tree


def honour_no_grad(traced: fx.Graph) -> fx.Graph:
    """``traced`` itself if no node ran under ``no_grad``; else a rewritten copy in which every
    such node reads detached inputs and its value is detached. ``traced`` is not modified."""
    frozen = set(no_grad_nodes(traced))
    if not frozen:
        return traced
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    detached: dict[fx.Node, fx.Node] = {}  # a value from outside a block, detached once

    def entering(n: fx.Node) -> fx.Node:
        if n in frozen:
            return env[n]  # already detached where it was produced
        if n not in detached:
            detached[n] = graph.call_function(detach_tree, (env[n],))
            detached[n].meta[GRAD_ENABLED] = False
        return detached[n]

    for node in traced.nodes:
        if node in frozen:
            copy = graph.node_copy(node, entering)
            env[node] = graph.call_function(detach_tree, (copy,))
            env[node].meta[GRAD_ENABLED] = False
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.lint()
    return graph
