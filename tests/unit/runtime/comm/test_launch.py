"""Device and process-group set-up, with CUDA faked (no GPU here): the user's device wins,
then LOCAL_RANK; the group gets both backends and its device before any collective."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipecut.runtime.comm import launch


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"current": 0, "initialized": False, "set": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: state["set"].append(i))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    return state


def test_local_rank_picks_the_device_when_the_user_chose_none(fake_cuda: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert launch.local_device() == torch.device("cuda", 2)
    assert fake_cuda["set"] == [2]


def test_a_device_the_user_set_is_kept(fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    fake_cuda.update(initialized=True, current=3)  # the user called torch.cuda.set_device(3)
    assert launch.local_device() == torch.device("cuda", 3)
    assert fake_cuda["set"] == [3]


def test_one_visible_gpu_per_process(fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "6")  # CUDA_VISIBLE_DEVICES left this process 4 devices
    assert launch.local_device() == torch.device("cuda", 0)


def test_the_group_gets_both_backends_and_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    timeout = datetime.timedelta(seconds=5)
    launch.ensure_process_group(timeout, torch.device("cuda", 1))
    launch.ensure_process_group(timeout, torch.device("cpu"))
    assert calls == [
        {"backend": "cpu:gloo,cuda:nccl", "timeout": timeout, "device_id": torch.device("cuda", 1)},
        {"backend": "gloo", "timeout": timeout, "device_id": None},
    ]
