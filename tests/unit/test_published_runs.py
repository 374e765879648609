"""The cluster model against published training runs (benchmarks/published.py), within tolerance.

One compute efficiency per device family, each fitted on one run (``fitted``); every run must
come within ±20% of its published throughput and ±15% of its published peak memory. The cost
tables are the stand-in ``llama_rows`` (the same rows ``estimate_costs`` gives, from the Llama
shapes): today's ``estimate_costs`` takes minutes per layer on the CPU at 8B width.
"""

from __future__ import annotations

import pytest

from benchmarks import published
from pipecut.clusters import FAMILY_EFFICIENCY, parse_cluster
from pipecut.devices import device_profile


@pytest.mark.parametrize("run", published.RUNS, ids=lambda r: r.name)
def test_prediction_within_tolerance_of_the_published_run(run: published.PublishedRun) -> None:
    p = published.predict(run)
    assert p.tokens_per_s_per_gpu == pytest.approx(run.tokens_per_s_per_gpu, rel=0.20)
    if run.memory_gib is not None:
        assert p.memory_gib == pytest.approx(run.memory_gib, rel=0.15)


def test_one_fitted_run_per_family_and_it_is_recorded() -> None:
    families = [device_profile(parse_cluster(r.cluster).device).family for r in published.RUNS if r.fitted]
    assert sorted(families) == sorted(set(families))
    for family in families:
        assert family in FAMILY_EFFICIENCY and "tokens/s" in FAMILY_EFFICIENCY[family][1]


def test_gpipe_speedup_on_four_times_the_stages() -> None:
    assert published.gpipe_speedup() == pytest.approx(published.GPIPE_SPEEDUP[0], rel=0.20)
