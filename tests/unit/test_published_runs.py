"""The cluster model on a captured meta Llama (benchmarks/published.py), within tolerance.

The per-op model of ``pipecut.profile.hardware`` prices the cost table ``estimate_costs`` gives
on a meta Llama (the path ``plan_cluster`` takes); every run must come within ±20% of its
published throughput and ±15% of its published peak memory. The validation table proper, on runs
the residuals were not fitted on, is tests/unit/test_validation_runs.py. The whole path (the estimate on fake
tensors, then the run model) is checked on the three 8B runs, about 10 s each; the 70B run
(25 s to estimate) is in ``benchmarks/cluster.py``'s table only.
"""

from __future__ import annotations

import pytest

from benchmarks import published
from pipecut.planning.cluster.figures import family_efficiency, parse_cluster
from pipecut.profile.devices import device_profile


def _within_tolerance(run: published.PublishedRun, p: published.Predicted) -> None:
    assert p.tokens_per_s_per_gpu == pytest.approx(run.tokens_per_s_per_gpu, rel=0.20)
    if run.memory_gib is not None:
        assert p.memory_gib == pytest.approx(run.memory_gib, rel=0.15)


@pytest.mark.parametrize("run", [r for r in published.RUNS if r.model == "llama3-8b"], ids=lambda r: r.name)
def test_prediction_from_the_meta_estimate_within_tolerance(run: published.PublishedRun) -> None:
    _within_tolerance(run, published.predict(run))


def test_one_fitted_run_per_family_and_it_is_recorded() -> None:
    families = [device_profile(parse_cluster(r.cluster).device).family for r in published.RUNS if r.fitted]
    assert sorted(families) == sorted(set(families))
    for run in (r for r in published.RUNS if r.fitted):
        value, source = family_efficiency(device_profile(parse_cluster(run.cluster).device))
        assert value <= 0.8 and "fitted on" in source


def test_gpipe_speedup_on_four_times_the_stages() -> None:
    assert published.gpipe_speedup() == pytest.approx(published.GPIPE_SPEEDUP[0], rel=0.20)
