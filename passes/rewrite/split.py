"""Split a captured graph into one GraphModule per stage, as the plan says.

Stage ``s`` gets placeholders for the values it receives (``plan.stages[s].inputs``, wire
order) followed by the model inputs it reads; ``get_attr`` nodes are copied into every stage
that reads them, and so are the nodes the plan marks ``rebuilt`` (a mask, rotary tables:
computed again from the inputs and buffers rather than received), so parameters keep their fully qualified names and a tied weight lives on each
stage that uses it. Every stage but the last returns the tuple of values it sends
(``plan.stages[s].outputs``); the last returns the model's output. A stage that recomputes
some blocks (``Recompute.SELECTIVE``) calls them through checkpointed segments
(:mod:`pipecut.passes.rewrite.segments`). The input graph is never modified: stage graphs are built
from copies of its nodes.

    >>> programs = split(captured.gm, plan)
    >>> sent = programs[0].module(*received, *model_inputs)
"""

from __future__ import annotations

import torch.fx as fx

from pipecut.core.graph import canonical_names, mutates_first_arg
from pipecut.core.kinds import LeafKind, Recompute
from pipecut.core.program import StageProgram
from pipecut.core.segment import Segment
from pipecut.errors import PlanError
from pipecut.ir import Plan
from pipecut.passes.rewrite.segments import checkpoint_segments

__all__ = ["split", "split_stage", "verify"]


def split(gm: fx.GraphModule, plan: Plan) -> tuple[StageProgram, ...]:
    """One :class:`StageProgram` per stage of ``plan``."""
    return tuple(split_stage(gm, plan, s) for s in range(plan.num_stages))


def split_stage(gm: fx.GraphModule, plan: Plan, index: int, segments: bool = True) -> StageProgram:
    """The program of one stage (a rank only builds its own). ``segments=False``: a stage
    planned with selective recompute comes flat, its recomputed runs not yet segments (a later
    pass rewrites the graph first, then segments it: tensor parallelism)."""
    stage = plan.stages[index]
    is_last = index == plan.num_stages - 1
    nodes = {n.name: n for n in gm.graph.nodes}
    missing = [name for name in (*stage.nodes, *stage.inputs) if name not in nodes]
    if missing:
        raise PlanError(
            f"stage {index} refers to node(s) {missing[:5]} that the captured graph lacks; "
            f"the plan was made for another graph: re-plan"
        )
    members = set(stage.nodes)
    needed = {a.name for name in stage.nodes for a in nodes[name].all_input_nodes}
    rebuilt = _rebuilt(nodes, needed - members - set(stage.inputs), plan, index, members)
    needed |= {a.name for name in rebuilt for a in nodes[name].all_input_nodes}
    mutating = any(mutates_first_arg(nodes[name], gm) for name in stage.nodes)

    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in stage.inputs:
        ph = graph.placeholder(name)
        ph.meta.update(nodes[name].meta)
        # An in-place op on a received leaf that requires grad is an autograd error; a clone
        # makes it a non-leaf and keeps the original's semantics (later readers see the write).
        leaves = plan.node(name).leaves
        is_tensor = len(leaves) == 1 and leaves[0].kind is LeafKind.TENSOR
        env[name] = graph.call_method("clone", (ph,)) if mutating and is_tensor else ph
    model_inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in needed and node.name not in env:
            env[node.name] = graph.placeholder(node.name)
            model_inputs.append(node.name)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.name in needed:
            env[node.name] = graph.node_copy(node)
        elif node.name in members or node.name in rebuilt:
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    if not is_last:
        graph.output(tuple(env[name] for name in stage.outputs))
    elif not any(n.op == "output" for n in graph.nodes):
        raise PlanError(f"the last stage ({index}) does not hold the graph's output node")
    graph.lint()
    module = fx.GraphModule(gm, graph, f"Stage{index}")
    if stage.recompute is Recompute.SELECTIVE and segments:
        module = checkpoint_segments(module, stage.recomputed, where=f"stage {index}")
    return StageProgram(
        index=index,
        module=module,
        received=tuple(stage.inputs),
        model_inputs=tuple(model_inputs),
        sent=tuple(stage.outputs),
        is_last=is_last,
    )


def _rebuilt(nodes: dict[str, fx.Node], wanted: set[str], plan: Plan, index: int, members: set[str]) -> set[str]:
    """The nodes stage ``index`` computes again rather than receives: what it reads that it
    neither holds nor receives, with the rebuilt nodes those are computed from."""
    out: set[str] = set()
    todo = [name for name in wanted if nodes[name].op not in ("placeholder", "get_attr")]
    while todo:
        name = todo.pop()
        if name in out:
            continue
        if not plan.node(name).rebuilt:
            raise PlanError(
                f"stage {index} reads {name}, which it neither holds, receives nor may compute "
                f"again (the plan does not mark it rebuilt): the plan's stages are inconsistent; re-plan"
            )
        out.add(name)
        todo += [a.name for a in nodes[name].all_input_nodes
                 if a.op not in ("placeholder", "get_attr") and a.name not in members]
    return out


def verify(gm: fx.GraphModule, programs: tuple[StageProgram, ...], plan: Plan) -> None:
    """Invariants checked after the pass (the tests run it on every example model): every
    compute node of ``gm`` is in exactly one stage program and nowhere else, each stage receives
    exactly what the previous one sends and uses or relays all of it, and each holds the
    parameters the plan gives it. Raises AssertionError naming the stage and values."""
    compute = {n.name for n in gm.graph.nodes if n.op.startswith("call_")}
    seen: dict[str, int] = {}
    for prog in programs:  # placement first: a misplaced node explains the other symptoms
        segments = [m.nodes for m in prog.module.modules() if isinstance(m, Segment)]
        for name in [n.name for n in prog.module.graph.nodes if n.op.startswith("call_")] + [
            n for names in segments for n in names
        ]:
            if name in compute:
                if name in seen and not plan.node(name).rebuilt:
                    raise AssertionError(f"node {name} runs on stages {seen[name]} and {prog.index}")
                seen[name] = prog.index
    lost = sorted(compute - set(seen))
    if lost:
        raise AssertionError(f"node(s) {lost[:5]} of the graph are on no stage")
    canonical = canonical_names(gm)
    for prog in programs:
        prog.module.graph.lint()
        if prog.index > 0 and prog.received != programs[prog.index - 1].sent:
            raise AssertionError(
                f"stage {prog.index} receives {prog.received}, "
                f"stage {prog.index - 1} sends {programs[prog.index - 1].sent}"
            )
        nodes = {n.name: n for n in prog.module.graph.nodes}
        unused = [v for v in prog.received if v in nodes and not nodes[v].users]
        if unused:
            raise AssertionError(f"stage {prog.index} receives {unused} but neither uses nor sends them")
        if not prog.is_last:
            missing = [v for v in prog.sent if v not in nodes]
            if missing:
                raise AssertionError(f"stage {prog.index} sends {missing}, which it neither computes nor receives")
        held = {canonical[id(p)] for p in prog.module.parameters()}
        planned = set(plan.stages[prog.index].parameters)
        if held != planned:
            raise AssertionError(
                f"stage {prog.index} holds parameters {sorted(held ^ planned)[:5]} differently "
                f"from the plan"
            )
