"""pipecut.planning.autoplan: choosing microbatches and schedule by predicted step time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipecut.core.kinds import DataParallelKind, Recompute, ScheduleKind
from pipecut.errors import InputError, PartitionError
from pipecut.options import AUTO, DataParallelOptions
from pipecut.planning.autoplan import choose_microbatches_and_schedule, schedules_to_try
from tests.unit.tiny import mlp_plan

G, F, Z, V = ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZERO_BUBBLE, ScheduleKind.INTERLEAVED_1F1B
ZV = ScheduleKind.ZBV


def run(times, *, microbatches=AUTO, schedule=AUTO, recompute=(), profiled=None, data_parallel=None):
    """``times[(m, kind)]``: predicted step ms (None: does not fit)."""
    nodes = mlp_plan().nodes

    def profile_at(first, first_target):
        if profiled is not None:
            profiled.append(first[0].shape[0])
        return nodes

    def partition(costs, m, kind):
        step = times[(m, kind)]
        if step is None:
            raise PartitionError(f"{m} does not fit")
        rc = Recompute.FULL if (m, kind) in recompute else Recompute.NONE
        return SimpleNamespace(predicted=SimpleNamespace(step_ms=step), stages=(SimpleNamespace(recompute=rc),),
                               data_parallel=data_parallel, schedule=kind)

    return choose_microbatches_and_schedule((torch.zeros(8, 3),), torch.zeros(8), ranks=2, microbatches=microbatches,
                  schedule=schedule, stages_per_rank=1, profile_at=profile_at, partition=partition)


def all_pairs(step):
    return {(m, k): step(m, k) for m in (2, 4, 8) for k in (G, F, Z, ZV)}


def test_the_fastest_pair_wins_and_every_pair_is_recorded():
    profiled = []
    m, kind, candidates = run(all_pairs(lambda m, k: 10.0 + m + (0 if k is G else 5)), profiled=profiled)
    assert (m, kind) == (2, G)
    assert len(candidates) == 12 and [c.note for c in candidates].count("chosen") == 1
    assert sorted(profiled) == [1, 4]  # profiled at the smallest and largest microbatch only


def test_within_one_percent_1f1b_then_fewer_microbatches_win():
    m, kind, _ = run(all_pairs(lambda m, k: 10.0 - 0.05 * (k is G) - 0.001 * m))
    assert (m, kind) == (2, F)
    # Beyond 1 % the faster schedule wins over the preferred one.
    m, kind, _ = run(all_pairs(lambda m, k: 10.0 - 0.5 * (k is G)))
    assert (m, kind) == (2, G)


def test_zero_bubble_with_recompute_is_weighed_and_plans_that_do_not_fit_are_ruled_out():
    times = all_pairs(lambda m, k: 50.0)
    times[(8, Z)] = 1.0
    times[(4, G)] = None
    m, kind, candidates = run(times, recompute={(8, Z)})
    assert (m, kind) == (8, Z)  # it recomputes, which a split backward runs
    notes = {(c.microbatches, c.schedule): c.note for c in candidates}
    assert notes[(8, Z)] == "chosen"
    assert notes[(4, G)] == "4 does not fit"


def test_zbv_is_a_candidate_and_wins_where_it_is_fastest():
    m, kind, _ = run(all_pairs(lambda m, k: 5.0 if (m, k) == (4, ZV) else 10.0))
    assert (m, kind) == (4, ZV)
    times = all_pairs(lambda m, k: 5.0 if k is ZV else 10.0)
    _, kind, _ = run(times, recompute={(m, ZV) for m in (2, 4, 8)})
    assert kind is ZV  # a split backward runs stages that recompute (tests/multiprocess/test_recompute.py)


def test_with_data_parallelism_split_backward_schedules_are_candidates_and_win_where_fastest():
    """The runtime runs zero-bubble and ZBV with DDP and FSDP2 replicas
    (tests/multiprocess/test_zero_bubble_replicas.py), so "auto" weighs them as with none. (Found
    by the fuzzer when the runtime refused them: compile(mesh, schedule="auto",
    data_parallel="ddp") chose ZBV, then refused it; they were ruled out until they ran.)"""
    times = all_pairs(lambda m, k: {ZV: 5.0, Z: 6.0}.get(k, 10.0))
    assert run(times)[:2] == (2, ZV)
    for kind in (DataParallelKind.DDP, DataParallelKind.FSDP):
        _, chosen, candidates = run(times, data_parallel=DataParallelOptions(kind=kind, replicas=2))
        assert chosen is ZV, kind
        assert all(c.step_ms is not None for c in candidates if c.schedule in (Z, ZV)), kind


def test_interleaved_counts_need_a_multiple_of_the_ranks_only_with_several_stages_per_rank():
    """Found by the fuzzer: a batch of 3 on 2 ranks under interleaved-1f1b with one stage per
    rank (plain 1F1B) was refused with "PartitionError: no microbatch count and schedule
    fits: " and no reason (every count was skipped silently)."""
    nodes = mlp_plan().nodes

    def partition(costs, m, kind):
        return SimpleNamespace(predicted=SimpleNamespace(step_ms=1.0), stages=(), data_parallel=None)

    def pick(v):
        return choose_microbatches_and_schedule((torch.zeros(3, 3),), torch.zeros(3), ranks=2, microbatches=AUTO, schedule=V,
                      stages_per_rank=v, profile_at=lambda first, target: nodes, partition=partition)

    assert pick(1)[:2] == (3, V)
    with pytest.raises(PartitionError, match="3/interleaved-1f1b: 2 stages per rank need a multiple of the 2 ranks"):
        pick(2)


def test_nothing_fits_and_bad_microbatches_are_refused():
    with pytest.raises(PartitionError, match="no microbatch count and schedule fits: 2/gpipe: 2 does not fit"):
        run(all_pairs(lambda m, k: None))
    with pytest.raises(InputError, match="microbatches must be an int or 'auto', got 'many'"):
        run({}, microbatches="many")
    assert run({(4, F): 3.0}, microbatches=4, schedule="1f1b")[:2] == (4, F)


def test_schedules_to_try():
    assert schedules_to_try(AUTO, 1) == (G, F, Z, ZV)
    assert schedules_to_try(AUTO, 2) == (V,)
    assert schedules_to_try("GPipe", 1) == (G,)
    with pytest.raises(InputError, match="unknown schedule 'fast'"):
        schedules_to_try("fast", 1)
