"""Liveness, cut sizes and the DP's promised errors."""

from __future__ import annotations

import pytest

import pipecut
from examples import gpt, resnet
from pipecut.cluster import Link
from pipecut.errors import InputError, PartitionError
from pipecut.passes.partition.chain import boundary_bytes, boundary_messages, boundary_ms, liveness
from pipecut.passes.partition.solve import partition_costs
from tests.exact_dp import Chain, partition_dp


def _nodes(build, **kw):  # type: ignore[no-untyped-def]
    model, inputs, loss_fn, target = build(batch_size=2)
    return pipecut.plan(
        model, inputs, 1, loss_fn=loss_fn, target=target,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0), **kw,
    ).nodes


def test_residual_stream_is_live_across_block_interiors() -> None:
    nodes = _nodes(resnet.build)
    live = liveness(nodes)
    fwd, _, allowed = boundary_bytes(nodes, live)
    assert fwd[0] == 0 and fwd[-1] == 0
    # Inside a residual block both the block input (identity) and the branch are live.
    assert max(len(live.crossing(b)) for b in range(len(live.units) + 1)) >= 2
    assert all(allowed)


def test_every_tensor_crossing_a_cut_is_a_message_that_pays_the_latency() -> None:
    nodes = _nodes(resnet.build)
    live = liveness(nodes)
    fwd, bwd, allowed = boundary_bytes(nodes, live)
    f_msgs, b_msgs = boundary_messages(nodes, live)
    # One tensor per value here: the count is the number of values crossing.
    assert f_msgs == [len(live.crossing(b)) for b in range(len(live.units) + 1)]
    assert b_msgs == f_msgs  # every crossing value carries a gradient back
    two = next(b for b, m in enumerate(f_msgs) if m == 2)  # inside a residual block
    link = Link(bandwidth_bytes_per_ms=1e6, latency_ms=1.0)
    ms = boundary_ms(fwd, bwd, allowed, link, (f_msgs, b_msgs))
    assert ms[two] == pytest.approx(4.0 + (fwd[two] + bwd[two]) / 1e6)  # 2 messages each way
    assert boundary_ms(fwd, bwd, allowed, link)[two] == pytest.approx(2.0 + (fwd[two] + bwd[two]) / 1e6)


def test_dp_is_exact_on_a_small_chain() -> None:
    chain = Chain(names=tuple("abcde"), compute_ms=(4, 1, 1, 1, 4), boundary_ms=(0, 0, 0, 0, 0, 0))
    part = partition_dp(chain, 3)
    assert part.bounds == (0, 1, 4, 5) and part.bottleneck_ms == 4


def test_dp_counts_communication() -> None:
    # Cutting after 'b' is free, after 'a' costs 10: the DP takes the free cut.
    chain = Chain(names=tuple("abc"), compute_ms=(1, 1, 1), boundary_ms=(0, 10, 0, 0))
    assert partition_dp(chain, 2).bounds == (0, 2, 3)


def test_stage_count_errors_carry_numbers() -> None:
    nodes = _nodes(gpt.build)
    units = len(liveness(nodes).units)
    with pytest.raises(PartitionError, match="at least 1, got 0"):
        partition_costs(nodes, devices=0, microbatches=1, batch_size=2)
    with pytest.raises(PartitionError, match=f"{units} partitionable nodes"):
        partition_costs(nodes, devices=units + 1, microbatches=1, batch_size=2)


def test_batch_must_split_into_microbatches() -> None:
    model, inputs, loss_fn, target = gpt.build(batch_size=6)
    with pytest.raises(InputError, match="batch of 6 does not split into 4"):
        pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=4)
