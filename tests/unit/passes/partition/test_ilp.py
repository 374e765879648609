"""The ILP and the exact bounded DP against brute force, and against the plain DP where it applies."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipecut
from pipecut.core.kinds import Recompute
from pipecut.errors import InputError, PartitionError
from pipecut.passes.partition.ilp import IlpSolver, IlpStatus, solve_ilp
from pipecut.passes.partition.memory_dp import partition_bounded
from pipecut.passes.partition.memory_partition import partition_ilp
from pipecut.passes.partition.problem import Evaluation, Problem, evaluate
from tests.exact_dp import Chain, partition_dp

SETTINGS = settings(max_examples=25, deadline=None)


def brute_force(problem: Problem) -> Evaluation | None:
    best = None
    for cuts in itertools.combinations(problem.allowed_cuts(), problem.stages - 1):
        ev = evaluate(problem, (0, *cuts, problem.units))
        if ev.fits and (best is None or ev.bottleneck_ms < best.bottleneck_ms):
            best = ev
    return best


@st.composite
def problems(draw, *, memory: bool = True, recompute: bool = True, hetero: bool = True,
             inputs: bool = True) -> Problem:
    n = draw(st.integers(2, 8))
    k = draw(st.integers(1, min(4, n)))
    compute = draw(st.lists(st.floats(0, 10), min_size=n, max_size=n))
    forward = [c * draw(st.floats(0.1, 0.6)) for c in compute]
    inner = draw(st.lists(st.one_of(st.floats(0, 3), st.just(math.inf)), min_size=n - 1,
                          max_size=n - 1))
    in_bytes = draw(st.lists(st.integers(0, 50), min_size=n - 1, max_size=n - 1)) if inputs else [0] * (n - 1)
    caps = [draw(st.one_of(st.none(), st.integers(40, 700))) if memory else None for _ in range(k)]
    return Problem(
        compute_ms=tuple(compute),
        forward_ms=tuple(forward),
        boundary_ms=(0.0, *inner, 0.0),
        input_bytes=(0, *in_bytes, 0),
        fixed_bytes=tuple(draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))),
        activation_bytes=tuple(draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))),
        speeds=tuple(draw(st.sampled_from([0.5, 1.0, 2.0])) if hetero else 1.0 for _ in range(k)),
        capacities=tuple(caps),
        inflight=tuple(draw(st.integers(1, 4)) for _ in range(k)),
        recompute=recompute and draw(st.booleans()),
    )


@SETTINGS
@given(problems())
def test_both_solvers_warm_started_from_the_dp_match_brute_force(problem: Problem) -> None:
    """HiGHS (the default, given the DP's split as a MIP start) and CBC find the same optimum."""
    truth = brute_force(problem)
    dp = partition_bounded(problem)
    for solver in IlpSolver:
        ilp = solve_ilp(problem, time_limit_s=30, solver=solver,
                        warm_start=dp.bounds if dp is not None else None)
        assert ilp.status in (IlpStatus.OPTIMAL, IlpStatus.INFEASIBLE), solver
        assert same(ilp.evaluation, truth), solver


def test_the_solver_is_chosen_by_name_and_recorded_in_the_plan() -> None:
    from tests.browser.plans import synthetic_nodes

    nodes = synthetic_nodes(3)
    devices = [pipecut.DeviceSpec(name="d", memory_bytes=2**30)] * 2
    kw = dict(devices=devices, microbatches=2, batch_size=4, inputs=("x",))
    default = pipecut.partition_costs(nodes, **kw)
    cbc = pipecut.partition_costs(nodes, partition=pipecut.PartitionOptions(solver="cbc"), **kw)
    assert default.solver.method is pipecut.Partitioner.ILP
    assert "ILP (HIGHS," in default.solver.detail and "ILP (CBC," in cbc.solver.detail
    assert default.stages == cbc.stages
    with pytest.raises(InputError, match=r"unknown ILP solver 'gurobi'; choose one of \['highs', 'cbc'\]"):
        pipecut.partition_costs(nodes, partition=pipecut.PartitionOptions(solver="gurobi"), **kw)


def same(a: Evaluation | None, b: Evaluation | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a.bottleneck_ms, b.bottleneck_ms, rel_tol=1e-7, abs_tol=1e-9)


@SETTINGS
@given(problems())
def test_ilp_and_bounded_dp_match_brute_force(problem: Problem) -> None:
    truth = brute_force(problem)
    ilp = solve_ilp(problem, time_limit_s=30)
    assert ilp.status in (IlpStatus.OPTIMAL, IlpStatus.INFEASIBLE)
    assert same(ilp.evaluation, truth)
    assert same(partition_bounded(problem), truth)
    if ilp.evaluation is not None:
        assert ilp.evaluation.fits


@SETTINGS
@given(problems(memory=False, recompute=False))
def test_ilp_agrees_with_plain_dp_without_memory(problem: Problem) -> None:
    allowed = problem.allowed_cuts()
    if len(allowed) < problem.stages - 1:
        return
    chain = Chain(names=tuple(map(str, range(problem.units))), compute_ms=problem.compute_ms,
                  boundary_ms=problem.boundary_ms)
    dp = partition_dp(chain, problem.stages, speeds=problem.speeds)
    ilp = solve_ilp(problem, time_limit_s=30)
    assert ilp.evaluation is not None
    assert math.isclose(ilp.evaluation.bottleneck_ms, dp.bottleneck_ms, rel_tol=1e-7, abs_tol=1e-9)


@SETTINGS
@given(problems(recompute=False, inputs=False))
def test_ilp_agrees_with_plain_dp_with_memory(problem: Problem) -> None:
    """The plain DP's memory model has no stage-input term: compare on problems without one."""
    if len(problem.allowed_cuts()) < problem.stages - 1:
        return
    chain = Chain(names=tuple(map(str, range(problem.units))), compute_ms=problem.compute_ms,
                  boundary_ms=problem.boundary_ms, fixed_bytes=problem.fixed_bytes,
                  activation_bytes=problem.activation_bytes)
    try:
        dp = partition_dp(chain, problem.stages, speeds=problem.speeds,
                          capacities=problem.capacities, inflight=problem.inflight)
    except PartitionError:
        dp = None
    ilp = solve_ilp(problem, time_limit_s=30)
    if dp is None:
        assert ilp.status is IlpStatus.INFEASIBLE
    else:
        assert ilp.evaluation is not None
        assert math.isclose(ilp.evaluation.bottleneck_ms, dp.bottleneck_ms, rel_tol=1e-7,
                            abs_tol=1e-9)


def _problem(capacity: float | None, recompute: bool, k: int = 2) -> Problem:
    n = 6
    return Problem(
        compute_ms=(3.0,) * n,
        forward_ms=(1.0,) * n,
        boundary_ms=(0.0,) + (0.1,) * (n - 1) + (0.0,),
        input_bytes=(0,) + (10,) * (n - 1) + (0,),
        fixed_bytes=(20,) * n,
        activation_bytes=(30,) * n,
        speeds=(1.0,) * k,
        capacities=(capacity,) * k,
        inflight=(2,) * k,
        recompute=recompute,
    )


def test_recompute_is_chosen_only_where_memory_needs_it() -> None:
    roomy = partition_ilp(_problem(10_000, recompute=True), time_limit_s=600)  # a proved optimum, load or not
    assert set(roomy.evaluation.recompute) == {Recompute.NONE}
    # 3 units per stage keep 60 + 2·(10 + 90) = 260 bytes; with recompute 60 + 2·10 = 80.
    tight = partition_ilp(_problem(200, recompute=True), time_limit_s=600)
    assert tight.evaluation.fits and tight.optimal
    assert Recompute.FULL in tight.evaluation.recompute
    assert tight.evaluation.bottleneck_ms > roomy.evaluation.bottleneck_ms


def test_infeasible_error_names_memory_and_device_count() -> None:
    with pytest.raises(PartitionError, match=r"without recompute; 2 devices would need 260 B each, or use 6 devices of 150 B"):
        partition_ilp(_problem(150, recompute=False), inflight_for=lambda k: [2] * k)
    with pytest.raises(PartitionError, match=r"even with recompute; 2 devices would need 80 B each, or use 5 devices"):
        partition_ilp(_problem(50, recompute=True), inflight_for=lambda k: [2] * k)


def test_too_many_stages_for_the_cuttable_places() -> None:
    p = _problem(None, recompute=False, k=3)
    blocked = Problem(**{**{f: getattr(p, f) for f in p.__slots__},
                         "boundary_ms": (0.0, math.inf, math.inf, 0.1, math.inf, math.inf, 0.0)})
    with pytest.raises(PartitionError, match="use at most 2 devices"):
        partition_ilp(blocked)
