"""Every stage holds a parameter: the DP, the bounded DP and the ILP agree with brute force under
the constraint, the stage count it allows is exact, and asking for more is a clear error."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipecut
from pipecut.core.kinds import LeafKind, NodeOp, Partitioner
from pipecut.errors import PartitionError
from pipecut.ir import Leaf, NodeCost
from pipecut.passes.partition.holders import max_stages, stage_count_error
from pipecut.passes.partition.ilp import solve_ilp
from pipecut.passes.partition.memory_dp import partition_bounded
from pipecut.passes.partition.memory_partition import partition_ilp
from pipecut.passes.partition.problem import Evaluation, Problem, evaluate
from pipecut.passes.partition.solve import partition_costs
from tests.exact_dp import Chain, partition_dp

SETTINGS = settings(max_examples=40, deadline=None)


def _brute_max(holds: tuple[bool, ...], positions: tuple[int, ...]) -> int:
    n, best = len(holds), 0
    for k in range(1, n + 1):
        for cuts in itertools.combinations(positions, k - 1):
            b = (0, *cuts, n)
            if all(any(holds[b[s] : b[s + 1]]) for s in range(k)):
                best = k
    return best


@SETTINGS
@given(st.lists(st.booleans(), min_size=1, max_size=9), st.data())
def test_max_stages_is_the_brute_force_maximum(holds: list[bool], data: st.DataObject) -> None:
    n = len(holds)
    positions = tuple(p for p in range(1, n) if data.draw(st.booleans()))
    assert max_stages(holds, positions) == _brute_max(tuple(holds), positions)


@st.composite
def constrained(draw) -> Problem:
    """Small problems where some units read no parameter, some cuts are blocked, maybe memory."""
    n = draw(st.integers(2, 8))
    holds = draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(any))
    inner = draw(st.lists(st.one_of(st.floats(0, 3), st.just(math.inf)), min_size=n - 1, max_size=n - 1))
    positions = tuple(b for b in range(1, n) if math.isfinite(inner[b - 1]))
    k = draw(st.integers(1, max(1, max_stages(holds, positions))))
    compute = draw(st.lists(st.floats(0, 10), min_size=n, max_size=n))
    memory = draw(st.booleans())
    return Problem(
        compute_ms=tuple(compute),
        forward_ms=tuple(0.5 * c for c in compute),
        boundary_ms=(0.0, *inner, 0.0),
        input_bytes=(0,) * (n + 1),
        fixed_bytes=tuple(draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))),
        activation_bytes=tuple(draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))),
        speeds=(1.0,) * k,
        capacities=tuple(draw(st.integers(100, 600)) if memory else None for _ in range(k)),
        inflight=(1,) * k,
        holds_params=tuple(holds),
    )


def _brute(problem: Problem) -> Evaluation | None:
    best = None
    for cuts in itertools.combinations(problem.allowed_cuts(), problem.stages - 1):
        ev = evaluate(problem, (0, *cuts, problem.units))
        if ev.fits and (best is None or ev.bottleneck_ms < best.bottleneck_ms):
            best = ev
    return best


def _every_stage_holds(problem: Problem, bounds: tuple[int, ...]) -> bool:
    return all(any(problem.holds_params[a:b]) for a, b in itertools.pairwise(bounds))


@SETTINGS
@given(constrained())
def test_solvers_agree_with_brute_force_under_the_constraint(problem: Problem) -> None:
    truth = _brute(problem)
    bounded = partition_bounded(problem)
    ilp = solve_ilp(problem, time_limit_s=30).evaluation
    if truth is None:  # memory rules every split out; none of the solvers may invent one
        assert bounded is None and (ilp is None or not ilp.fits)
        return
    assert _every_stage_holds(problem, truth.bounds)
    for ev in (bounded, ilp):
        assert ev is not None and ev.fits and _every_stage_holds(problem, ev.bounds)
        assert math.isclose(ev.bottleneck_ms, truth.bottleneck_ms, rel_tol=1e-7, abs_tol=1e-9)
    if all(c is None for c in problem.capacities):  # the plain DP applies: it agrees too
        chain = Chain(names=tuple(map(str, range(problem.units))), compute_ms=problem.compute_ms,
                      boundary_ms=problem.boundary_ms, holds_params=problem.holds_params)
        dp = partition_dp(chain, problem.stages)
        assert _every_stage_holds(problem, dp.bounds)
        assert math.isclose(dp.bottleneck_ms, truth.bottleneck_ms, rel_tol=1e-7, abs_tol=1e-9)


def test_the_fastest_split_is_refused_when_it_leaves_a_stage_without_parameters() -> None:
    # [fc1] [heavy] [heavier] [fc2] [fc3]: balance alone gives the heavier op a stage of its own.
    compute, holds = (1, 10, 12, 1, 1), (True, False, False, True, True)
    free = Chain(names=tuple("abcde"), compute_ms=compute, boundary_ms=(0,) * 6)
    assert partition_dp(free, 3).bounds == (0, 2, 3, 5)  # stage 1 = [heavier]: no parameter
    held = Chain(names=tuple("abcde"), compute_ms=compute, boundary_ms=(0,) * 6, holds_params=holds)
    assert partition_dp(held, 3).bounds == (0, 2, 4, 5)  # 11, 13, 1 ms: slower, but trains


def test_more_stages_than_parameterised_nodes_is_a_partition_error() -> None:
    holds = (True, False, False, True)
    chain = Chain(names=tuple("abcd"), compute_ms=(1, 10, 10, 1), boundary_ms=(0,) * 5,
                  holds_params=holds)
    with pytest.raises(PartitionError, match=r"at most 2 pipeline stages .*\(2 of its 4 .*Use at most 2 devices"):
        partition_dp(chain, 3)
    problem = Problem(
        compute_ms=(1, 10, 10, 1), forward_ms=(0,) * 4, boundary_ms=(0,) * 5, input_bytes=(0,) * 5,
        fixed_bytes=(0,) * 4, activation_bytes=(0,) * 4, speeds=(1.0,) * 3,
        capacities=(None,) * 3, inflight=(1,) * 3, holds_params=holds,
    )
    with pytest.raises(PartitionError, match="at most 2 pipeline stages"):
        partition_ilp(problem)
    assert stage_count_error(2, holds, (1, 2, 3)) is None
    assert stage_count_error(9, (False,) * 4, (1, 2, 3)) is None  # no parameters: nothing to check


def _node(name: str, op: NodeOp, inputs: tuple[str, ...], ms: float, params: tuple[str, ...] = ()) -> NodeCost:
    leaf = Leaf(kind=LeafKind.TENSOR, shape=(2, 4), dtype="float32", requires_grad=True)
    return NodeCost(
        name=name, op=op, target=name, inputs=inputs, forward_ms=ms, backward_ms=ms,
        output_bytes=32, param_bytes=64 * len(params), parameters=params, leaves=(leaf,),
        treespec="leaf",
    )


def _table() -> tuple[NodeCost, ...]:
    """x -> fc1 -> two heavy ops without parameters -> fc2 -> fc3 -> output: the chain of
    test_the_fastest_split_is_refused..., where the fastest 3-way split isolates ``heavier``."""
    return (
        _node("x", NodeOp.PLACEHOLDER, (), 0.0),
        _node("fc1", NodeOp.CALL_MODULE, ("x",), 0.5, ("fc1.weight",)),
        _node("heavy", NodeOp.CALL_FUNCTION, ("fc1",), 5.0),
        _node("heavier", NodeOp.CALL_FUNCTION, ("heavy",), 6.0),
        _node("fc2", NodeOp.CALL_MODULE, ("heavier",), 0.5, ("fc2.weight",)),
        _node("fc3", NodeOp.CALL_MODULE, ("fc2",), 0.5, ("fc3.weight",)),
        _node("output", NodeOp.OUTPUT, ("fc3",), 0.0),
    )


@pytest.mark.parametrize("partitioner", ["dp", "ilp"])
def test_every_planned_stage_has_parameters(partitioner: str) -> None:
    method = Partitioner.DP if partitioner == "dp" else Partitioner.ILP
    plan = partition_costs(
        _table(), devices=3, microbatches=1, batch_size=2,
        partition=pipecut.PartitionOptions(partitioner=method),
    )
    assert [s.nodes for s in plan.stages] == [("fc1", "heavy"), ("heavier", "fc2"), ("fc3", "output")]
    assert all(stage.parameters for stage in plan.stages)
    with pytest.raises(PartitionError, match="at most 3 pipeline stages"):
        partition_costs(
            _table(), devices=4, microbatches=1, batch_size=2,
            partition=pipecut.PartitionOptions(partitioner=method),
        )
