"""Per-block recompute inside a stage: runs of nodes called through ``torch.utils.checkpoint``.

A stage planned with ``Recompute.SELECTIVE`` keeps the activations of most of its nodes and
recomputes a few blocks (``Stage.recomputed``). This pass returns a new stage module in which
each maximal run of recomputed nodes is one call of a :class:`~pipecut.core.segment.Segment`: the run's nodes, called
through non-reentrant ``checkpoint``, so only the run's inputs are kept and its forward runs
again inside backward (with the RNG state of the first run: dropout draws the same mask).

Each segment reads the stage's own parameters and buffers by their names
(:mod:`pipecut.core.segment`): nothing is renamed or registered twice.

A node that writes in place into a value computed outside its run (``x.relu_()`` on the run's
input, ``copy_`` into a BatchNorm statistic under torch.export) is never recomputed: run again,
it would write twice, or read its own write. It stays outside, splitting the run.

    >>> stage = checkpoint_segments(program.module, ("h_0_attn", "h_0_mlp"))
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from functools import partial

import torch.fx as fx

from pipecut.core.graph import mutates_first_arg
from pipecut.core.segment import Segment
from pipecut.errors import PlanError

__all__ = ["checkpoint_segments", "segment_runs"]


def segment_runs(gm: fx.GraphModule, recomputed: Collection[str]) -> list[list[fx.Node]]:
    """Maximal runs of consecutive recomputed compute nodes, split where a node writes into a
    value from outside its run. ``get_attr`` nodes do not split a run: a segment reads the
    stage's parameters and buffers itself, at each run (so a recompute reads, and writes into,
    the buffers :mod:`pipecut.runtime.execution.recompute_state` puts in place for it)."""
    runs: list[list[fx.Node]] = [[]]
    members: set[fx.Node] = set()  # of the run being built
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        first = node.args[0] if node.args else None
        writes_outside = mutates_first_arg(node, gm) and isinstance(first, fx.Node) and first not in members
        if node.name in recomputed and node.op.startswith("call_") and not writes_outside:
            runs[-1].append(node)
            members.add(node)
        elif runs[-1]:
            runs.append([])
            members = set()
    return [run for run in runs if run]


def checkpoint_segments(gm: fx.GraphModule, recomputed: Collection[str], where: str = "the stage") -> fx.GraphModule:
    """A copy of ``gm`` whose ``recomputed`` nodes run in checkpointed :class:`Segment` calls."""
    unknown = sorted(set(recomputed) - {n.name for n in gm.graph.nodes})
    if unknown:
        raise PlanError(
            f"{where} recomputes node(s) {unknown[:5]} that its graph lacks; "
            f"the plan was made for another graph: re-plan"
        )
    graph = fx.Graph()  # a stage's graph has the default code generation (see passes/rewrite/split.py)
    graph.output(graph.graph_copy(gm.graph, {}))
    out = fx.GraphModule(gm, graph, type(gm).__name__)
    out.training = gm.training
    for i, run in enumerate(segment_runs(out, recomputed)):
        members = set(run)
        inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes
                                    if a not in members and a.op != "get_attr"))
        outputs = [n for n in run if any(u not in members for u in n.users)]
        name = f"recompute_{i}"
        out.add_submodule(name, Segment(out, _run_graph(run, inputs, outputs), tuple(n.name for n in run)))
        with out.graph.inserting_before(run[-1].next):  # after every input, before every reader
            call = out.graph.call_module(name, tuple(inputs))
            for k, value in enumerate(outputs):
                item = out.graph.create_node("call_function", operator.getitem, (call, k), name=f"{name}_out{k}")
                item.meta.update(value.meta)
                value.replace_all_uses_with(item, delete_user_cb=partial(_outside, members))
        for node in reversed(run):
            out.graph.erase_node(node)
    out.graph.lint()
    out.recompile()
    return out

def _outside(members: set[fx.Node], user: fx.Node) -> bool:
    return user not in members


def _run_graph(run: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta.update(a.meta)
    for n in run:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:  # read through the stage module when it runs
                env[a] = graph.node_copy(a)
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[n] for n in outputs))
    return graph
