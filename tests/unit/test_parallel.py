"""pipecut.parallel: data parallelism as plan data."""

from __future__ import annotations

import dataclasses

import pytest

from pipecut.core.kinds import DataParallelKind
from pipecut.errors import InputError
from pipecut.parallel import DataParallel, as_data_parallel


@pytest.mark.parametrize(("value", "kind"), [("ddp", DataParallelKind.DDP), ("FSDP", DataParallelKind.FSDP),
                                             (DataParallelKind.DDP, DataParallelKind.DDP)])
def test_as_data_parallel_accepts_names_in_any_case_and_the_enum(value, kind):
    assert as_data_parallel(value) is kind


def test_unknown_data_parallel_lists_the_options():
    with pytest.raises(InputError, match=r"unknown data_parallel 'zero3'; choose one of \['ddp', 'fsdp'\]"):
        as_data_parallel("zero3")


def test_data_parallel_needs_a_replica_and_is_frozen():
    dp = DataParallel(kind=DataParallelKind.FSDP, replicas=2)
    assert dp.replicas == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        dp.replicas = 3  # type: ignore[misc]
    with pytest.raises(InputError, match="at least 1 replica, got 0"):
        DataParallel(kind=DataParallelKind.DDP, replicas=0)
