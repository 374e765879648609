"""Per-stage replication DP: a hand-checked uneven win, brute force on tiny chains, never worse
than uniform replication under the same cost model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecut.cluster import Link
from pipecut.core.kinds import ScheduleKind
from pipecut.errors import PartitionError
from pipecut.passes.costs.workload import Workload
from pipecut.passes.parallel.hybrid import ShapeCandidate, plan_hybrid
from pipecut.passes.parallel.replication import (
    ReplicationKind,
    inflight,
    plan_replicated,
    stage_memory_bytes,
    stage_ms,
)

INSTANT = Link(bandwidth_bytes_per_ms=1e30)
ONE_BYTE_PER_MS = Link(bandwidth_bytes_per_ms=1.0)

# A: 9 ms of compute and 3 bytes of gradients; B: 3 ms and 12 bytes (a light layer with many
# parameters, like an LM head). Microbatch of 12 samples, so replica counts 1, 2, 3, 4 all divide.
HEAVY_LIGHT = Workload(forward_ms=(3.0, 1.0), backward_ms=(6.0, 2.0), param_bytes=(3, 12))
GPIPE = dict(microbatches=4, batch_size=48, schedule=ScheduleKind.GPIPE, link=INSTANT,
             allreduce=ONE_BYTE_PER_MS)


def test_heavy_layer_gets_three_replicas():
    # Per microbatch, stage_ms = compute / r + ring(params, r) / M with ring = 2(r-1)/r · bytes:
    #   A×3, B×1: 9/3 + (4/3·3)/4 = 4,   3/1 = 3                 -> bottleneck 4
    #   A×2, B×2: 9/2 + (1·3)/4 = 5.25,  3/2 + (1·12)/4 = 4.5   -> 5.25 (uniform D=2, K=2)
    #   AB×4:     12/4 + (1.5·15)/4 = 8.625                     -> 8.625 (uniform D=4, K=1)
    plan = plan_replicated(HEAVY_LIGHT, devices=4, **GPIPE)
    assert plan.bounds == (0, 1, 2) and plan.per_stage == (3, 1)
    assert plan.stage_ms == pytest.approx((4.0, 3.0)) and plan.bottleneck_ms == pytest.approx(4.0)
    assert plan.replica_choices == (1, 2, 3, 4)
    # GPipe, stages of 1 + 2 ms: stage 0 ends its last backward at (4 + 2 - 1) · 3 = 15 ms, then
    # all-reduces 4/3 · 3 = 4 ms -> 19 ms; stage 1 ends at 13 ms with nothing to reduce.
    assert plan.pipeline_ms == pytest.approx(15.0) and plan.step_ms == pytest.approx(19.0)
    assert plan.allreduce_ms == pytest.approx((4.0, 0.0))
    assert plan.efficiency == pytest.approx(4 * 12 / (4 * 19))


def test_plan_hybrid_compares_with_uniform():
    # Uniform D=2, K=2 by hand: stage 0 (1.5 + 3 ms) ends at 19.5 ms, + ring 3 bytes over 2 = 3
    # -> 22.5; stage 1 (0.5 + 1 ms) ends at 10.5, + 12 -> 22.5. D=4: 4·3 + 1.5·15 = 34.5.
    plan = plan_hybrid(HEAVY_LIGHT, devices=4, prune=False, replication=ReplicationKind.PER_STAGE,
                       **GPIPE)
    assert {(c.replicas, c.stages): c.step_ms for c in plan.candidates} == {
        (2, 2): pytest.approx(22.5), (4, 1): pytest.approx(34.5)}
    assert plan.per_stage is not None and plan.per_stage.per_stage == (3, 1)
    assert plan.fastest is plan.per_stage
    assert plan_hybrid(HEAVY_LIGHT, devices=4, **GPIPE).per_stage is None


def test_replica_counts_must_divide_the_microbatch():
    # Microbatch of 2 samples: only 1 or 2 replicas per stage, so 4 devices need 2 × 2 or more
    # stages; with 2 units that is A×2, B×2.
    kw = {**GPIPE, "batch_size": 8}
    plan = plan_replicated(HEAVY_LIGHT, devices=4, **kw)
    assert plan.replica_choices == (1, 2) and plan.per_stage == (2, 2)
    with pytest.raises(PartitionError, match=r"replica counts \(1, 2\) \(divisors of the microbatch size 2"):
        plan_replicated(HEAVY_LIGHT, devices=5, **kw)


def test_memory_limit_and_errors():
    # 3 bytes of parameters take 12 with gradients and Adam state; 12 bytes take 48.
    assert stage_memory_bytes(HEAVY_LIGHT, 0, 2, 4, inflight=4) == 60
    plan = plan_replicated(HEAVY_LIGHT, devices=4, memory_bytes=48, **GPIPE)
    assert plan.peak_memory_bytes <= 48 and plan.stages == 2
    with pytest.raises(PartitionError, match="fits in 4e-08 GB per device"):
        plan_replicated(HEAVY_LIGHT, devices=4, memory_bytes=40, **GPIPE)
    with pytest.raises(PartitionError, match="batch size 50 does not split into 4 microbatches"):
        plan_replicated(HEAVY_LIGHT, devices=4, **{**GPIPE, "batch_size": 50})
    with pytest.raises(PartitionError, match="devices must be at least 1"):
        plan_replicated(HEAVY_LIGHT, devices=0, **GPIPE)


def test_inflight_bound():
    assert inflight(ScheduleKind.GPIPE, 8, 4, 1) == 8
    assert [inflight(ScheduleKind.ONE_F_ONE_B, 8, 4, u) for u in (1, 2, 4)] == [4, 3, 1]
    assert inflight(ScheduleKind.ONE_F_ONE_B, 2, 4, 1) == 2


def bottleneck(work, bounds, reps, devices, memory, schedule, **kw):
    """max stage_ms of one split and replica vector; inf if a stage does not fit in memory."""
    worst, used = 0.0, 0
    for s, r in enumerate(reps):
        used += r
        held = inflight(schedule, kw["microbatches"], devices, used)
        if memory is not None and stage_memory_bytes(
                work, bounds[s], bounds[s + 1], r, held) > memory:
            return float("inf")
        worst = max(worst, stage_ms(work, bounds[s], bounds[s + 1], r, **kw))
    return worst


def brute_force(work, devices, choices, memory, schedule, **kw):
    """Min over every split and replica vector of max stage_ms; None if nothing fits."""
    n, best = work.units, float("inf")
    for k in range(1, min(n, devices) + 1):
        for inner in itertools.combinations(range(1, n), k - 1):
            for reps in itertools.product(choices, repeat=k):
                if sum(reps) == devices:
                    best = min(best, bottleneck(work, (0, *inner, n), reps, devices, memory,
                                                schedule, **kw))
    return None if best == float("inf") else best


units = st.lists(
    st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 5.0), st.integers(0, 50), st.integers(0, 50),
              st.integers(0, 100)),
    min_size=1, max_size=6,
)


@settings(max_examples=80, deadline=None)
@given(units, st.integers(1, 5), st.sampled_from([1, 2, 4, 6, 12]), st.sampled_from([1, 2, 4]),
       st.floats(0.5, 100.0), st.floats(0.5, 100.0), st.one_of(st.none(), st.integers(0, 600)),
       st.sampled_from([ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B]),
       st.lists(st.booleans(), min_size=7, max_size=7))
def test_equals_brute_force(us, devices, size, m, p2p, ring, memory, schedule, cross):
    n = len(us)
    work = Workload(
        forward_ms=tuple(u[0] for u in us), backward_ms=tuple(u[1] for u in us),
        param_bytes=tuple(u[2] for u in us), activation_bytes=tuple(u[3] for u in us),
        cut_forward_bytes=(7, *(u[4] for u in us)),
        cut_backward_bytes=(0, *(u[4] // 2 for u in us)),
        crossable=(True, *cross[: n - 1], True),
    )
    link = Link(bandwidth_bytes_per_ms=p2p, latency_ms=0.01)
    allreduce = Link(bandwidth_bytes_per_ms=ring, latency_ms=0.02)
    choices = tuple(r for r in range(1, devices + 1) if size % r == 0)
    kw = dict(microbatches=m, link=link, allreduce=allreduce)
    expected = brute_force(work, devices, choices, memory, schedule, **kw)
    if expected is None:
        with pytest.raises(PartitionError):
            plan_replicated(work, devices=devices, batch_size=m * size, schedule=schedule,
                            memory_bytes=memory, **kw)
        return
    plan = plan_replicated(work, devices=devices, batch_size=m * size, schedule=schedule,
                           memory_bytes=memory, **kw)
    assert plan.bottleneck_ms == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert sum(plan.per_stage) == devices and plan.bounds[0] == 0 and plan.bounds[-1] == n
    assert all(size % r == 0 for r in plan.per_stage)
    if memory is not None:
        assert plan.peak_memory_bytes <= memory
    # never worse than any uniform D × K split under the same stage_ms
    for d in choices:
        if devices % d == 0:
            k = devices // d
            for inner in itertools.combinations(range(1, n), k - 1):
                uniform = bottleneck(work, (0, *inner, n), (d,) * k, devices, memory,
                                     schedule, **kw)
                assert plan.bottleneck_ms <= uniform + 1e-9


@settings(max_examples=25, deadline=None)
@given(units, st.sampled_from([2, 4]), st.sampled_from([ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B]))
def test_fastest_never_worse_than_best_uniform(us, devices, schedule):
    work = Workload(forward_ms=tuple(u[0] for u in us), backward_ms=tuple(u[1] for u in us),
                    param_bytes=tuple(u[2] for u in us))
    try:
        plan = plan_hybrid(work, devices=devices, microbatches=4, batch_size=16,
                           schedule=schedule, link=INSTANT, allreduce=ONE_BYTE_PER_MS,
                           replication=ReplicationKind.PER_STAGE)
    except PartitionError:
        return
    assert isinstance(plan.best, ShapeCandidate) and plan.per_stage is not None
    assert plan.fastest.step_ms <= plan.best.step_ms


def test_one_f_one_b_memory_counts_devices_after_the_stage():
    # Two units of 2 ms, 10 activation bytes each, 1F1B with 4 microbatches on 2 devices.
    # Split 1 + 1: stage 0 keeps min(4, 1 + 1 device after it) = 2 microbatches -> 20 bytes.
    # One stage on 2 replicas keeps 1 microbatch of 20 bytes, half per replica -> 10 bytes.
    work = Workload(forward_ms=(1.0, 1.0), backward_ms=(1.0, 1.0), param_bytes=(0, 0),
                    activation_bytes=(10, 10))
    kw = dict(devices=2, microbatches=4, batch_size=8, link=INSTANT, allreduce=INSTANT)
    assert plan_replicated(work, memory_bytes=20, **kw).peak_memory_bytes == 20
    plan = plan_replicated(work, memory_bytes=12, **kw)
    assert plan.per_stage == (2,) and plan.peak_memory_bytes == 10
    with pytest.raises(PartitionError, match="no split of 2 units over exactly 2 devices"):
        plan_replicated(work, memory_bytes=9, **kw)
