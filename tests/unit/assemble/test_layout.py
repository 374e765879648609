"""pipecut.assemble.layout without processes: one replica has no engine. The layouts themselves
are read across processes (tests/multiprocess/test_layout.py); the engine a mesh gets by default
is resolved, and named in refusals, by pipecut.planning.asked (tests/unit/planning/test_asked.py)."""

from __future__ import annotations

import pytest

from pipecut.assemble.layout import RankGroups, replication_of
from pipecut.planning.asked import NO_REPLICAS


def test_no_replicas_is_no_engine() -> None:
    assert replication_of(RankGroups(None, None, None, ((0, 1),), 2), NO_REPLICAS) is None
    with pytest.raises(AssertionError, match="refuses replicas without a 'dp' dimension"):
        replication_of(RankGroups(None, None, None, ((0, 1),), 2), "ddp")  # type: ignore[arg-type]
