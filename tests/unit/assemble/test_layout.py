"""pipecut.assemble.layout without processes: how a refusal names the replicas' default engine.
The layouts themselves are read across processes (tests/multiprocess/test_layout.py)."""

from __future__ import annotations

from pipecut.assemble.layout import RankGroups, engine_origin
from pipecut.core.kinds import DataParallelKind


def test_an_engine_left_out_is_named_as_the_meshs_default() -> None:
    """replication_of gives DDP by default over a "dp" dimension, FSDP2 beside a "tp" one: a
    refusal says that the engine was that default; an engine asked for has no origin."""
    group = object()  # stands for the "dp" process group
    dp = RankGroups(None, group, None, ((0,), (1,)), 1)
    dp_tp = RankGroups(None, group, None, ((0,), (1,)), 1, tp_mesh=object())
    assert engine_origin(dp, None) == "the default for a mesh with a 'dp' dimension"
    assert engine_origin(dp_tp, None) == "the default for a mesh with a 'dp' dimension and tensor parallelism"
    assert engine_origin(dp_tp, DataParallelKind.FSDP) == engine_origin(dp, "ddp") == ""
    assert engine_origin(RankGroups(None, None, None, ((0, 1),), 2), None) == ""  # no replicas: no engine
