"""Plans from a fixed cost table, so that a parity check is the same on every machine.

Measured costs depend on the machine's load, and with them the split, the order of a
zero-bubble schedule's weight passes and so the order in which gradients are summed. A parity
test that must give the same answer on every run (a strict xfail most of all) plans from
:class:`FixedCosts` instead: every node of the captured graph costs 1 ms forward and 2 ms
backward, so the DP cuts by node count (also inside a module called repeatedly, like ALBERT's
shared layer, where a split given as module names cannot) and the schedule's order follows.
A split may still be given as module names, to cut where the structure says.

    costs = fixed_costs("t5", microbatches=2, models=ARCHITECTURES, batch_size=4)
    plan = fixed_plan(costs, world=2, schedule="zbv", split=("encoder.block.2", "decoder", ...))
    pipecut.compile(model, 2, ..., plan=plan)          # replayed: nothing is timed
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pipecut
from examples.zoo import Factories, factory, stages_per_rank_of
from pipecut.capture import capture, fingerprint
from pipecut.capture.modes import describe_graph
from pipecut.core.batching import first_microbatch
from pipecut.core.kinds import CaptureMethod
from pipecut.ir import NodeCost, Plan
from pipecut.passes.partition.chain import is_unit
from pipecut.passes.partition.solve import partition_costs

FORWARD_MS, BACKWARD_MS = 1.0, 2.0
"""Every node's cost: only the ratio matters (backward about twice forward, as usual)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedCosts:
    """A model's captured graph at one microbatch size as a cost table with set costs."""

    rows: tuple[NodeCost, ...]
    fingerprint: str
    capture: CaptureMethod
    inputs: tuple[str, ...]
    batch_size: int
    microbatches: int


def fixed_costs(name: str, microbatches: int, *, models: Factories | None = None,
                batch_size: int = 8, seed: int = 0) -> FixedCosts:
    """Capture model ``name`` at its first microbatch and give every node the same cost.

    The graph depends on the microbatch's size only, so one table serves every schedule that
    splits the same batch into the same number of microbatches.
    """
    model, inputs, _, _ = factory(name, models)(batch_size=batch_size, seed=seed)
    size, first = first_microbatch(inputs, microbatches)
    captured = capture(model, first)
    rows = tuple(dataclasses.replace(n, forward_ms=FORWARD_MS, backward_ms=BACKWARD_MS) if is_unit(n) else n
                 for n in describe_graph(captured, captured.flatten_inputs(first)))
    return FixedCosts(rows=rows, fingerprint=fingerprint(captured.gm), capture=captured.method,
                      inputs=tuple(captured.input_names), batch_size=size, microbatches=microbatches)


def fixed_plan(costs: FixedCosts, world: int, schedule: str | pipecut.ScheduleKind,
               split: tuple[str, ...] | None = None) -> Plan:
    """The plan of ``costs`` over ``world`` ranks under ``schedule`` (interleaved 1F1B and ZBV
    with 2 stages per rank); ``split``: the modules where stages 1.. begin, else the DP's cut."""
    kind = pipecut.ScheduleKind(schedule)
    return partition_costs(
        costs.rows, devices=world, microbatches=costs.microbatches, batch_size=costs.batch_size,
        schedule=kind, stages_per_rank=stages_per_rank_of(kind),
        partition=pipecut.PartitionOptions(split=split), fingerprint=costs.fingerprint,
        capture=costs.capture, inputs=costs.inputs,
    )


def first_block_recomputed(plan: Plan) -> Plan:
    """``plan`` with each stage recomputing its first block (selective recompute): the nodes of
    the first numbered module it holds (``transformer.h.0.``, ``model.layers.3.``, ...); a stage
    without one recomputes nothing."""
    stages = []
    for stage in plan.stages:
        blocks = [m.group(1) for n in stage.nodes if (m := re.match(r"(.*?\.\d+\.)", plan.node(n).module + "."))]
        chosen = tuple(n for n in stage.nodes if blocks and (plan.node(n).module + ".").startswith(blocks[0]))
        stages.append(dataclasses.replace(stage, recompute=pipecut.Recompute.SELECTIVE if chosen else stage.recompute,
                                          recomputed=chosen))
    return dataclasses.replace(plan, stages=tuple(stages))
