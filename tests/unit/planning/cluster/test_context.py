"""pipecut.planning.cluster.context: context parallelism priced as a ring of key and value chunks."""

from __future__ import annotations

import pytest

from pipecut.cluster import Link
from pipecut.core.kinds import NodeOp
from pipecut.ir import NodeCost
from pipecut.planning.cluster.context import (
    BACKWARD_RING_BYTES,
    attention_flops_scale,
    ring_exposed_ms,
    with_context_parallel,
)
from pipecut.profile.flops import NodeWork

LINK = Link(name="nvlink", bandwidth_bytes_per_ms=1e8, latency_ms=0.01)


def test_each_ring_step_hides_under_one_chunk_s_attention() -> None:
    # 4 ranks: 3 steps of 1e6 bytes (0.01 + 0.01 ms each) under a quarter of the attention each
    assert ring_exposed_ms(8.0, 1e6, 4, LINK) == 0.0
    assert ring_exposed_ms(0.04, 1e6, 4, LINK) == pytest.approx(3 * (0.02 - 0.01))
    assert ring_exposed_ms(5.0, 1e6, 1, LINK) == 0.0  # no context parallelism, no ring
    assert attention_flops_scale(4) == 4  # a quarter of the queries against all the keys


def test_the_ring_is_added_to_attention_rows_at_one_rank_s_share_only() -> None:
    attn = NodeCost(name="sdpa", op=NodeOp.CALL_FUNCTION, target="scaled_dot_product_attention",
                    forward_ms=0.08, backward_ms=0.2)
    mlp = NodeCost(name="up", op=NodeOp.CALL_FUNCTION, target="linear", forward_ms=1.0, backward_ms=2.0)
    work = {"sdpa": NodeWork(forward_flops=10**9, backward_flops=25 * 10**8), "up": NodeWork(forward_flops=10**9)}
    got = with_context_parallel((attn, mlp), work, 4, LINK, {"sdpa": 1e6}, replicas=2)
    per = ring_exposed_ms(0.08 / 2, 1e6, 4, LINK)  # one rank's share of the table's two replicas
    back = ring_exposed_ms(0.2 / 2, BACKWARD_RING_BYTES * 1e6, 4, LINK)
    assert per > 0 and back > 0
    assert got[0].forward_ms == pytest.approx(0.08 + 2 * per) and got[0].backward_ms == pytest.approx(0.2 + 2 * back)
    assert got[1] == mlp
    assert with_context_parallel((attn, mlp), work, 1, LINK, {"sdpa": 1e6}) == (attn, mlp)
