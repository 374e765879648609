"""Splits given by module names: bounds, errors, and the plan's cost beside the optimum."""

from __future__ import annotations

import pytest

import pipecut
from examples import gpt
from pipecut.core.kinds import NodeOp, Partitioner
from pipecut.errors import PartitionError
from pipecut.ir import NodeCost
from pipecut.passes.partition.pinned import bounds_from_modules, bounds_from_split_points
from pipecut.passes.partition.solve import partition_costs


def _units(modules: list[str]) -> list[NodeCost]:
    return [NodeCost(name=f"n{i}", op=NodeOp.CALL_FUNCTION, target="f", module=m) for i, m in enumerate(modules)]


UNITS = _units(["emb", "blocks.0.a", "blocks.0.b", "", "blocks.1.a", "blocks.1.b", "", "head", ""])


def test_modules_per_stage_and_split_points_give_the_same_bounds() -> None:
    by_modules = bounds_from_modules(UNITS, [["emb", "blocks.0"], ["blocks.1", "head"]])
    assert by_modules == (0, 4, 9)  # the top-level node after blocks.0 stays with stage 0
    assert bounds_from_split_points(UNITS, ["blocks.1"]) == by_modules
    # The longest listed path wins: blocks.1 in stage 1 even though "blocks" is in stage 0.
    assert bounds_from_modules(UNITS, [["emb", "blocks"], ["blocks.1", "head"]]) == (0, 4, 9)


@pytest.mark.parametrize(
    ("split", "match"),
    [
        ([["blocks.1"], ["blocks.0", "head"]], "not contiguous: node n4"),
        ([["emb", "blocks"], ["nope"]], r"module\(s\) \['nope'\] with no node"),
        ([["emb"], []], "stage 1 of the given split lists no module"),
        ([["emb", "blocks.0"], ["blocks.0"]], "listed for stages 0 and 1"),
    ],
)
def test_bad_module_splits_are_refused(split: list[list[str]], match: str) -> None:
    with pytest.raises(PartitionError, match=match):
        bounds_from_modules(UNITS, split)


def test_bad_split_points_are_refused() -> None:
    with pytest.raises(PartitionError, match=r"split point 'blocks.1' starts at node n4, not after"):
        bounds_from_split_points(UNITS, ["head", "blocks.1"])
    with pytest.raises(PartitionError, match=r"names no module.*top-level modules: blocks, emb, head"):
        bounds_from_split_points(UNITS, ["mlp"])


@pytest.fixture(scope="module")
def gpt_costs() -> tuple[NodeCost, ...]:
    model, inputs, loss_fn, target = gpt.build(batch_size=4)
    return pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(calibrate=False, repeats=1, warmup=0),
    ).nodes


def test_a_given_split_is_planned_and_priced_beside_the_optimum(gpt_costs: tuple[NodeCost, ...]) -> None:
    kw = dict(devices=2, microbatches=2, batch_size=4)
    best = partition_costs(gpt_costs, **kw)
    given = partition_costs(
        gpt_costs, partition=pipecut.PartitionOptions(split=["blocks.3"]), **kw,
    )
    assert given.solver.method is Partitioner.GIVEN and "blocks.3" in given.solver.detail
    assert given.stages[1].nodes[0] == next(n.name for n in gpt_costs if n.module.startswith("blocks.3"))
    # Beside the given split: the step pipecut's own partitioner predicts for the same setting
    # (its objective is the slowest stage, so the simulated step can still come out either way).
    assert given.predicted.optimum_step_ms == pytest.approx(best.predicted.step_ms)
    assert best.predicted.optimum_step_ms == best.predicted.step_ms
    assert "pipecut's own split is predicted at" in pipecut.summary(given)
    with pytest.raises(PartitionError, match="has 2 stages but 4 are planned"):
        partition_costs(
            gpt_costs, partition=pipecut.PartitionOptions(split=["blocks.3"]),
            **{**kw, "devices": 4},
        )
