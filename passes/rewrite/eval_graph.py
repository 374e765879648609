"""Map a second graph of the same model (captured in the other train/eval mode) onto a plan's stages.

Capture specialises the training flag: ``torch.export`` bakes ``dropout(x, p, train=True)`` and
``batch_norm(..., training=True)`` into the graph, and ``symbolic_trace`` evaluates Python
branches on ``self.training``. Evaluation (or training a model compiled in eval mode) therefore
needs the graph captured in that mode, cut at the same stage boundaries. Any assignment of its
nodes to stages computes the model exactly, provided that

- values only flow forwards (a node's stage is at least each input's stage), and
- every parameter and buffer is read on a stage that holds it in the plan (the weights a rank
  trains, the BatchNorm statistics it updates, live on that rank only).

Export names nodes by per-op counters and symbolic_trace by module paths, so most nodes keep
their name across modes; a node keeps the stage its namesake has in the plan when the two rules
allow it (the split then stays balanced as planned), and otherwise goes to the earliest stage they
allow. When no stage satisfies both rules the mapping is refused, naming the node.

    >>> stages = map_stages(plan, primary_reads, nodes, reads)
    >>> other = dataclasses.replace(plan, nodes=nodes, stages=stages, edges=(), _index={})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pipecut.core.kinds import NodeOp, Recompute
from pipecut.errors import PlanError
from pipecut.ir import NodeCost, Plan, Stage
from pipecut.passes.costs.stages import stage_params
from pipecut.passes.partition.chain import is_unit

__all__ = ["holders", "map_stages"]


def holders(plan: Plan, reads: Mapping[str, tuple[str, ...]]) -> dict[str, frozenset[int]]:
    """Parameter/buffer name -> the stages that hold it under ``plan`` (``reads``: unit ->
    state names it reads, directly or through ``get_attr`` inputs)."""
    held: dict[str, set[int]] = {}
    for stage in plan.stages:
        for name in stage.nodes:
            for fqn in reads.get(name, ()):
                held.setdefault(fqn, set()).add(stage.index)
    return {fqn: frozenset(s) for fqn, s in held.items()}


def _assign(
    nodes: Sequence[NodeCost],
    anchor: Mapping[str, int],
    held: Mapping[str, frozenset[int]],
    reads: Mapping[str, tuple[str, ...]],
    k: int,
) -> dict[str, int]:
    units = [n for n in nodes if is_unit(n)]
    unit_names = {n.name for n in units}
    users: dict[str, list[str]] = {}
    for n in units:
        for src in n.inputs:
            if src in unit_names:
                users.setdefault(src, []).append(n.name)

    def allowed(n: NodeCost) -> frozenset[int]:
        stages = frozenset(range(k)) if n.op is not NodeOp.OUTPUT else frozenset({k - 1})
        for fqn in reads.get(n.name, ()):
            stages &= held.get(fqn, stages)  # state no stage holds is the same on every rank
        return stages

    allow = {n.name: allowed(n) for n in units}
    upper: dict[str, int] = {}
    for n in reversed(units):  # the latest stage that leaves room for every later node
        bound = max(allow[n.name], default=-1)
        for u in users.get(n.name, ()):
            bound = min(bound, upper[u])
        upper[n.name] = bound
    stage_of: dict[str, int] = {}
    for n in units:
        lower = max((stage_of[i] for i in n.inputs if i in stage_of), default=0)
        options = sorted(s for s in allow[n.name] if lower <= s <= upper[n.name])
        if not options:
            state = [f for f in reads.get(n.name, ()) if f in held]
            producers = {i: stage_of[i] for i in n.inputs if i in stage_of}
            raise PlanError(
                f"cannot place node {n.name!r} ({n.target}) of the other-mode graph on the "
                f"plan's stages: its inputs come from stages {producers or '{}'}, it reads "
                f"{state[:4]} held by stages {[sorted(held[f]) for f in state[:4]]}, and the nodes "
                f"that depend on it need it by stage {upper[n.name]}, so no stage satisfies all "
                f"three. Values must flow forwards and weights stay where the plan put "
                f"them; re-plan with the model in this mode (call model.train()/model.eval() "
                f"before pipecut.compile) or move the mode-dependent code into one module."
            )
        preferred = anchor.get(n.name)
        stage_of[n.name] = preferred if preferred in options else options[0]
    return stage_of


def map_stages(
    plan: Plan,
    primary_reads: Mapping[str, tuple[str, ...]],
    nodes: Sequence[NodeCost],
    reads: Mapping[str, tuple[str, ...]],
) -> tuple[Stage, ...]:
    """The plan's stages re-cut for another graph of the same model (``nodes``, in topological
    order, with ``reads`` of parameters/buffers per unit); raises :class:`PlanError` if it
    cannot be cut consistently. Costs are the plan's: only the node lists and wiring change."""
    k = plan.num_stages
    stage_of = _assign(nodes, plan.stage_of(), holders(plan, primary_reads), reads, k)
    order = sorted((n for n in nodes if n.name in stage_of), key=lambda n: stage_of[n.name])  # stable
    last_reader: dict[str, int] = {}
    for n in order:
        for src in n.inputs:
            if src in stage_of:
                last_reader[src] = max(last_reader.get(src, -1), stage_of[n.name])
    by_name = {n.name: n for n in nodes}
    stages = []
    for st in plan.stages:
        s = st.index
        members = [n for n in order if stage_of[n.name] == s]
        crossing_in = [n.name for n in order if stage_of[n.name] < s <= last_reader.get(n.name, -1)]
        crossing_out = [n.name for n in order if stage_of[n.name] <= s < last_reader.get(n.name, -1)]
        params, _ = stage_params(members, by_name)
        # Recompute the same blocks where the node names match; none match: the whole stage
        # (memory no higher than planned, whatever the other graph's nodes are).
        chosen = set(st.recomputed)
        recomputed = tuple(n.name for n in members if n.name in chosen)
        recompute = st.recompute
        if recompute is Recompute.SELECTIVE and not recomputed:
            recompute = Recompute.FULL
        stages.append(dataclasses.replace(
            st, nodes=tuple(n.name for n in members), inputs=tuple(crossing_in),
            outputs=tuple(crossing_out) if s < k - 1 else (), parameters=params,
            recompute=recompute, recomputed=recomputed,
        ))
    return tuple(stages)
