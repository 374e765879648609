"""Capacities from the hardware: free CUDA memory fills the capacities the user left unset."""

from __future__ import annotations

import pytest
import torch

from pipecut.ir import DeviceSpec
from pipecut.runtime.memory.capacity import free_bytes, with_capacities


def test_unset_capacities_come_from_each_ranks_free_memory() -> None:
    specs = (DeviceSpec(name="cuda"), DeviceSpec(name="cuda", memory_bytes=5), DeviceSpec(name="cuda"))
    got = with_capacities(specs, [100, 200, None])
    assert [s.memory_bytes for s in got] == [100, 5, None]  # given: kept; no reading: unlimited


def test_interleaved_stages_take_their_ranks_memory() -> None:
    got = with_capacities([DeviceSpec(name="cuda")] * 4, [100, 200])  # stage s on rank s % 2
    assert [s.memory_bytes for s in got] == [100, 200, 100, 200]


def test_cpu_sets_no_limit() -> None:
    assert free_bytes(torch.device("cpu")) is None
    assert with_capacities([DeviceSpec(name="cpu")], [None]) == (DeviceSpec(name="cpu"),)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reads_mem_get_info() -> None:
    free = free_bytes(torch.device("cuda", 0))
    assert free is not None and 0 < free <= torch.cuda.get_device_properties(0).total_memory
