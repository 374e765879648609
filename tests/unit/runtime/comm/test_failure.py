"""pipecut.runtime.comm.failure: the first failing rank is recorded and named by the others."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from pipecut.errors import PipelineRuntimeError
from pipecut.runtime.comm import failure
from pipecut.runtime.comm.failure import FAILURE_KEY, abort, first_failure


def store() -> dist.Store:
    return dist.HashStore()


def test_first_failure_reads_the_store():
    s = store()
    assert first_failure(None) is None
    assert first_failure(s) is None
    s.set(FAILURE_KEY, "rank 2: ValueError: bad")
    assert first_failure(s) == "rank 2: ValueError: bad"


def test_abort_records_the_first_failure_and_names_it_on_other_ranks(monkeypatch):
    s = store()
    s.set_timeout(datetime.timedelta(seconds=5))
    monkeypatch.setattr(failure, "_store", lambda: s)
    error = ValueError("shape mismatch at node fc1")
    assert abort(2, error) is error  # the failing rank raises its own error
    assert first_failure(s) == "rank 2: ValueError: shape mismatch at node fc1"
    later = abort(1, ZeroDivisionError("second"))
    assert isinstance(later, ZeroDivisionError)
    assert first_failure(s).startswith("rank 2")  # only the first is recorded
    neighbour = abort(3, PipelineRuntimeError("connection closed"))
    assert isinstance(neighbour, PipelineRuntimeError)
    assert str(neighbour) == "rank 3 stopped because rank 2: ValueError: shape mismatch at node fc1"


def test_abort_without_a_store_returns_the_error(monkeypatch):
    monkeypatch.setattr(failure, "_store", lambda: None)
    error = PipelineRuntimeError("peer 1 went away")
    assert abort(0, error) is error
