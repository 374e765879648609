"""The link between neighbouring ranks is measured, and every rank gets the same answer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipecut.runtime.comm.linkprobe import measure_link
from tests.harness import run_ranks

pytestmark = pytest.mark.dist


def _probe(rank: int, world: int) -> Any:
    link = measure_link(list(range(world)), rank, None, torch.device("cpu"), repeats=3)
    return None if link is None else (link.bandwidth_bytes_per_ms, link.latency_ms, link.measured)


@pytest.mark.timeout(120)
def test_every_rank_gets_the_same_measured_link() -> None:
    links = run_ranks(_probe, 3, timeout=100)
    assert len(set(links)) == 1, links
    bandwidth, latency, measured = links[0]
    # gloo over loopback moves between ~10 MB/s and ~100 GB/s on any machine this runs on.
    assert measured and 1e4 < bandwidth < 1e8 and 0.0 <= latency < 1000.0
    assert run_ranks(_probe, 1, timeout=60) == [None]  # one rank: no link to measure


def test_noise_cannot_make_the_link_infinitely_fast() -> None:
    # A loaded host once timed the 4 KiB message slower than the 4 MiB one: the slope was
    # negative, and the probe reported 4e18 bytes/ms. Half the large message's time now bounds it.
    from pipecut.runtime.comm.linkprobe import LARGE_BYTES, _per_byte_ms

    assert _per_byte_ms(small_ms=0.5, large_ms=0.4) == pytest.approx(0.4 / LARGE_BYTES / 2)
    assert _per_byte_ms(small_ms=0.0, large_ms=0.0) == 1e-12
    slope = _per_byte_ms(small_ms=0.1, large_ms=4.1)  # a clean measurement keeps its slope
    assert slope == pytest.approx(4.0 / (LARGE_BYTES - (4 << 10)))
