"""D × K planner: hand-checked steps on a uniform chain, and never worse than pure DP or pure PP."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from benchmarks.synthetic import transformer_costs
from pipecut.cluster import Link
from pipecut.core.kinds import ScheduleKind
from pipecut.errors import PartitionError
from pipecut.passes.parallel.hybrid import (
    ShapeCandidate,
    ShapeSkipped,
    Workload,
    evaluate,
    plan_hybrid,
    ring_allreduce_ms,
    workload,
)

INSTANT = Link(bandwidth_bytes_per_ms=1e30)
ONE_BYTE_PER_MS = Link(bandwidth_bytes_per_ms=1.0)


def uniform(params: int) -> Workload:
    """8 units of forward 1 ms, backward 2 ms (at microbatch B / M), ``params`` bytes each."""
    return Workload(forward_ms=(1.0,) * 8, backward_ms=(2.0,) * 8, param_bytes=(params,) * 8)


def steps(plan) -> dict[tuple[int, int], float]:
    return {(c.replicas, c.stages): c.step_ms for c in plan.candidates}


@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B])
def test_without_gradients_pure_data_parallel_wins(kind):
    # D=4: one stage, 24 ms/4 per microbatch, 4 microbatches -> 24 ms, perfect scaling.
    # D=2,K=2: stages of 6 ms per microbatch at half size: (M + K - 1) * 6 = 30 ms.
    # D=1,K=4: stages of 2+4 ms: (4 + 3) * 6 = 42 ms.
    plan = plan_hybrid(uniform(0), devices=4, microbatches=4, batch_size=16, schedule=kind,
                       link=INSTANT, allreduce=ONE_BYTE_PER_MS, prune=False)
    assert steps(plan) == {(4, 1): 24.0, (2, 2): 30.0, (1, 4): 42.0}
    assert plan.best.replicas == 4 and plan.best.efficiency == pytest.approx(1.0)
    assert plan.single_device_ms == 96.0


def test_all_reduce_cost_makes_the_pipeline_win():
    # 5 bytes per unit at 1 byte/ms. D=4: ring over 40 bytes = 2*3/4*40 = 60 ms after 24 ms.
    # D=2,K=2: each stage 20 bytes -> 20 ms; GPipe ends stage 0 at 30 ms, stage 1 at 26 ms -> 50.
    plan = plan_hybrid(uniform(5), devices=4, microbatches=4, batch_size=16,
                       schedule=ScheduleKind.GPIPE, link=INSTANT, allreduce=ONE_BYTE_PER_MS,
                       prune=False)
    assert steps(plan) == {(1, 4): 42.0, (2, 2): 50.0, (4, 1): 84.0}
    assert [c.stages for c in plan.candidates] == [4, 2, 1]
    two = plan.candidates[1]
    assert two.allreduce_ms == (20.0, 20.0) and two.pipeline_ms == 30.0
    assert plan.best.efficiency == pytest.approx(96 / (4 * 42))


def test_ring_all_reduce_formula():
    link = Link(bandwidth_bytes_per_ms=10.0, latency_ms=0.5)
    assert ring_allreduce_ms(1000, 1, link) == 0.0
    assert ring_allreduce_ms(1000, 4, link) == pytest.approx(6 * 0.5 + 1.5 * 1000 / 10)


def test_microbatch_that_does_not_split_is_skipped_with_reason():
    plan = plan_hybrid(uniform(0), devices=4, microbatches=4, batch_size=8,
                       link=INSTANT, allreduce=ONE_BYTE_PER_MS, prune=False)
    assert {(c.replicas, c.stages) for c in plan.candidates} == {(1, 4), (2, 2)}
    (skip,) = plan.skipped
    assert (skip.replicas, skip.stages) == (4, 1) and "2 samples" in skip.reason


def test_memory_capacity_forces_stages():
    work = Workload(forward_ms=(1.0,) * 8, backward_ms=(2.0,) * 8, param_bytes=(100,) * 8)
    # 100 bytes of parameters cost 400 with gradients and optimizer state: at most 2 units fit
    # in 1000 bytes, so only the 4-stage pipeline fits.
    plan = plan_hybrid(work, devices=4, microbatches=4, batch_size=16, link=INSTANT,
                       allreduce=ONE_BYTE_PER_MS, memory_bytes=1000, prune=False)
    assert [(c.replicas, c.stages) for c in plan.candidates] == [(1, 4)]
    assert plan.best.peak_memory_bytes <= 1000
    with pytest.raises(PartitionError, match="no way to run this model on 2 devices"):
        plan_hybrid(work, devices=2, microbatches=4, batch_size=16, link=INSTANT,
                    allreduce=ONE_BYTE_PER_MS, memory_bytes=1000)


def test_pruning_keeps_the_best():
    work = workload(transformer_costs(4, nodes_per_layer=40))
    kw = dict(devices=8, microbatches=4, batch_size=32, link=Link(bandwidth_bytes_per_ms=1e5),
              allreduce=Link(bandwidth_bytes_per_ms=1e4))
    full, pruned = plan_hybrid(work, prune=False, **kw), plan_hybrid(work, **kw)
    assert pruned.best == full.best
    assert len(pruned.candidates) + len(pruned.skipped) == 4


def test_bad_batch_is_refused():
    with pytest.raises(PartitionError, match="does not split into 3 microbatches"):
        plan_hybrid(uniform(0), devices=2, microbatches=3, batch_size=8, link=INSTANT,
                    allreduce=INSTANT)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 5.0), st.integers(0, 1000)),
             min_size=4, max_size=10),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2, 4]),
    st.floats(1.0, 1000.0),
    st.floats(1.0, 1000.0),
    st.sampled_from(list(ScheduleKind)[:2]),
)
@example([(0.0, 0.0, 0)] * 3 + [(0.0, 0.0, 1)], 2, 1, 1.0, 1.0, ScheduleKind.GPIPE)  # one unit holds parameters
def test_never_worse_than_pure_data_or_pure_pipeline(units, devices, m, p2p, ring, kind):
    work = Workload(
        forward_ms=tuple(u[0] for u in units), backward_ms=tuple(u[1] for u in units),
        param_bytes=tuple(u[2] for u in units),
        cut_forward_bytes=tuple(range(0, 100 * (len(units) + 1), 100)),
        cut_backward_bytes=tuple(range(0, 50 * (len(units) + 1), 50)),
    )
    kw = dict(microbatches=m, batch_size=m * 4, schedule=kind,
              link=Link(bandwidth_bytes_per_ms=p2p, latency_ms=0.01),
              allreduce=Link(bandwidth_bytes_per_ms=ring, latency_ms=0.01))
    plan = plan_hybrid(work, devices=devices, **kw)
    ranked = [c.step_ms for c in plan.candidates]
    assert ranked == sorted(ranked)
    for d, k in ((devices, 1), (1, devices)):
        ref = evaluate(work, d, k, **kw)
        if 0 < sum(u[2] > 0 for u in units) < k:  # each stage must train one (found by hypothesis)
            assert isinstance(ref, ShapeSkipped) and "of the units hold parameters" in ref.reason, ref
            continue
        assert isinstance(ref, ShapeCandidate)
        assert plan.best.step_ms <= ref.step_ms + 1e-9
        assert ref.step_ms >= max(ref.pipeline_ms, 0.0)


def test_each_shape_takes_the_fastest_engine_that_fits():
    """8 units of 10 bytes; at 2 x 2 a stage holds 40 bytes of parameters, so DDP 160 bytes of
    state, ZeRO-1 80 + 80/2 = 120 and FSDP 80 + 160/2 = 160 (no activations here). With room
    DDP's all-reduce, the cheapest, wins; at 130 bytes only ZeRO-1 fits."""
    from pipecut.core.kinds import DataParallelKind
    from pipecut.passes.parallel.hybrid import evaluate_engines

    work = uniform(10)
    every = (DataParallelKind.DDP, DataParallelKind.ZERO1, DataParallelKind.FSDP)
    args = {"microbatches": 4, "batch_size": 16, "link": INSTANT, "allreduce": ONE_BYTE_PER_MS}
    roomy = evaluate_engines(work, 2, 2, shardings=every, memory_bytes=2**31, **args)
    assert isinstance(roomy, ShapeCandidate) and roomy.sharding is DataParallelKind.DDP
    tight = evaluate_engines(work, 2, 2, shardings=every, memory_bytes=130, **args)
    assert isinstance(tight, ShapeCandidate) and tight.sharding is DataParallelKind.ZERO1
    assert tight.peak_memory_bytes == 4 * (20 + 10)
    assert tight.allreduce_ms == (1.5 * 40, 1.5 * 40)  # ZeRO-1: 1.5 x the all-reduce of 40 bytes
    ddp_only = evaluate_engines(work, 2, 2, shardings=(DataParallelKind.DDP,), memory_bytes=130, **args)
    assert isinstance(ddp_only, ShapeSkipped) and "under ddp" in ddp_only.reason
    alone = evaluate_engines(work, 1, 4, shardings=every, memory_bytes=2**31, **args)
    assert isinstance(alone, ShapeCandidate) and alone.sharding is DataParallelKind.DDP  # nothing to shard
