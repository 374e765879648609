"""Shared test set-up: one intra-op thread (ranks are forked; OpenMP must not be live in the parent).

``--jitter-clock=SEED`` plays a loaded machine (seeded by SEED and the test's id): every time
pipecut measures (nodes and stages by :class:`~pipecut.core.clock.Timer`, the running
pipeline's stages in live calibration) is scaled by a log-uniform factor from 1/4 to 4, and one
time in :data:`SPIKE_ODDS` by :data:`SPIKE` more (the process was descheduled); the ILP's time
limits shrink by :data:`SLOWER`; torch.export's bound on a symbolic capture shrinks by 1 to
:data:`JITTER` times, with the same spikes, so that one capture of a test may run out where
another does not. A test whose outcome changes under it depends on the clock: its plan should
come from counted costs (``MeasureOptions(estimate=...)``) or a pinned split
(``PartitionOptions(split=...)``), its tolerance hold for any split. It is an audit, not part of
``make test``: ``make jitter-check`` runs the unit suite under it (forked ranks inherit it, so
``pytest tests/multiprocess/... --jitter-clock=1`` works too).
"""

from __future__ import annotations

import dataclasses
import datetime
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings

torch.set_num_threads(1)

# The suite draws the same examples on every run, so that its result does not depend on the
# draw (a random draw once found a real bug in the middle of an unrelated change), and no
# example has a deadline (hypothesis's default 200 ms is a clock a loaded machine misses).
# Exploring is `pytest --hypothesis-profile=explore`, beside the fuzz campaign (benchmarks/fuzz.py).
settings.register_profile("suite", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("suite")

JITTER = 4.0
"""``--jitter-clock`` scales each measured time by a log-uniform factor in [1/JITTER, JITTER] ..."""
SPIKE, SPIKE_ODDS = 20.0, 20
"""... and one time in SPIKE_ODDS by SPIKE more."""
SLOWER = 10.0
"""``--jitter-clock`` divides every ILP time limit by this."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--jitter-clock", type=int, default=None, metavar="SEED",
                     help="scale every time pipecut measures by a seeded random factor (an audit for clock-dependent tests)")


@pytest.fixture(autouse=True)
def _jitter_clock(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    seed = request.config.getoption("--jitter-clock")
    if seed is not None and request.node.get_closest_marker("clock") is None:
        _jitter(monkeypatch, random.Random(f"{seed}:{request.node.nodeid}"))
    yield


def _jitter(monkeypatch: pytest.MonkeyPatch, rng: random.Random) -> None:
    """Patch the clocks pipecut's results can depend on: node and stage times, the running
    pipeline's stage times (live calibration, every rank alike: forked ranks draw the same), the
    ILP's time limit and torch.export's bound."""
    import pipecut.api as api
    import pipecut.capture.trace as trace
    import pipecut.passes.partition.ilp as ilp
    import pipecut.profile.compiled as compiled
    from pipecut.core.clock import Timer

    measured, solver, bound, live = Timer.sampled, ilp._pulp_solver, trace.time_bound, api.measure_stages

    def spike() -> float:
        return SPIKE if rng.randrange(SPIKE_ODDS) == 0 else 1.0

    def sampled(self: Timer, fn: Callable[[], Any]) -> tuple[float, Any]:
        ms, result = measured(self, fn)
        return ms * factor(), result

    def factor() -> float:
        return JITTER ** rng.uniform(-1, 1) * spike()

    def running(*args: Any, **kwargs: Any) -> Any:
        times = live(*args, **kwargs)
        return dataclasses.replace(times, stages=tuple((f * factor(), b * factor()) for f, b in times.stages),
                                   step_ms=times.step_ms * factor())

    def hurried(kind: Any, time_limit_s: float | None, warm: bool) -> Any:
        return solver(kind, None if time_limit_s is None else time_limit_s / SLOWER, warm)

    def sooner(seconds: float | None) -> Any:
        return bound(None if seconds is None else seconds / JITTER ** rng.random() / spike())

    monkeypatch.setattr(Timer, "sampled", sampled)
    monkeypatch.setattr(ilp, "_pulp_solver", hurried)
    monkeypatch.setattr(trace, "time_bound", sooner)
    monkeypatch.setattr(api, "measure_stages", running)
    monkeypatch.setattr(compiled, "measure_stages", running)


@pytest.fixture
def one_rank_mesh(tmp_path: Path) -> Iterator[Any]:
    """A one-rank gloo group and its 1-D ("tp") DeviceMesh in this process, for DTensor's rules
    without forking (several ranks: tests/harness.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()
