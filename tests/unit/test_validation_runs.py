"""The cluster model against published runs it was not fitted on (benchmarks/validation_runs.json).

Issue 29's targets on the unfitted rows: median |throughput error| <= 10%, worst <= 20%, memory
within 15%, and every ordering a source publishes (schedules, microbatches, layout, memory)
reproduced. The table is priced from each model's shapes (benchmarks/validation.py), a few seconds
for all rows.
"""

from __future__ import annotations

import itertools
import statistics

import pytest

from benchmarks import validation
from pipecut.planning.cluster.frameworks import framework
from pipecut.profile.devices import device_profile


@pytest.fixture(scope="module")
def table() -> dict[str, validation.Prediction]:
    return {p.name: p for p in validation.table()}


def test_the_data_meets_the_issues_shape() -> None:
    data = validation.load()
    runs = data["runs"]
    assert len([r for r in runs if not r["fitted"]]) >= 12
    assert len({r["source"].split("-")[0] for r in runs}) >= 3
    assert {r["cluster"].split("x")[2].split("-")[0] for r in runs} >= {"A100", "H100"}
    assert len([r for r in runs if r["dp"] == "none" and r["pp"] > 1]) >= 3
    fitted = [r["name"] for r in runs if r["fitted"]]
    assert sorted(fitted) == sorted(name for key, name in data["split"].items() if not key.startswith("declared"))
    for r in runs:
        assert r["source"] in data["sources"] and r["where"], r["name"]
        assert framework(r["framework"]), r["name"]  # every run names the framework that ran it


def test_unfitted_rows_within_the_issues_tolerance(table: dict[str, validation.Prediction]) -> None:
    unfitted = [p for p in table.values() if not p.fitted and p.issue == 29]
    errors = {p.name: round(p.error, 3) for p in unfitted}
    assert statistics.median(abs(e) for e in errors.values()) <= 0.10, errors
    assert max(abs(e) for e in errors.values()) <= 0.20, errors
    for p in unfitted:
        if p.memory_error is not None:
            assert abs(p.memory_error) <= 0.15, (p.name, p.memory_gib, p.published_memory_gib)


def test_tensor_parallel_rows_within_the_tolerance_and_every_miss_beyond_15_percent_explained(
        table: dict[str, validation.Prediction]) -> None:
    """Issue 28's rows (torchtitan 3D, Megatron PTD-P, and the torch.compile + Float8 rows that
    price the 3D runs' kernels) are checks, not fits: each within issue 29's tolerance (±20%
    throughput, ±15% memory), and a throughput miss beyond 15% said."""
    rows = [p for p in table.values() if p.issue == 28 and not p.fitted]
    # 10 before Megatron's kernels had a figure of their own, fitted on one of them (2026-12-02)
    assert len([p for p in rows if p.tensor_parallel == 8]) >= 9
    for p in rows:
        assert abs(p.error) <= 0.20, (p.name, p.error)
        assert p.memory_error is None or abs(p.memory_error) <= 0.15, (p.name, p.memory_error)
        assert abs(p.error) <= 0.15 or p.explained, (p.name, p.error)
    megatron = [p for p in rows if p.name.startswith("megatron-")]
    assert max(abs(p.error) for p in megatron) <= 0.15, {p.name: round(p.error, 3) for p in megatron}


def test_fitted_rows_are_reproduced(table: dict[str, validation.Prediction]) -> None:
    for p in table.values():
        if p.fitted:
            assert p.error == pytest.approx(0, abs=0.01), p.name


def _reproduced(order: dict[str, object], table: dict[str, validation.Prediction]) -> bool:
    if "faster_first" in order:
        tokens = [table[n].tokens for n in order["faster_first"]]  # type: ignore[attr-defined]
        return tokens == sorted(tokens, reverse=True)
    # memory: never reversed; pipecut's zero bubble (ZB-H1) keeps exactly 1F1B's activations,
    # where the paper's ZB-1p measured 2 GB more, so a tie is allowed there
    mem = [table[n].memory_gib for n in order["larger_first"]]  # type: ignore[attr-defined]
    return all(a >= b - 1e-6 for a, b in itertools.pairwise(mem))


def test_published_orderings_reproduced(table: dict[str, validation.Prediction]) -> None:
    """Every ordering a source publishes, but one of issue 28's that says why the model misses
    it; that one must still be missed (else its explanation is stale). Issue 29's all hold."""
    for order in validation.load()["orderings"]:
        if order.get("explained"):
            assert order["issue"] == 28 and not _reproduced(order, table), order
        else:
            assert _reproduced(order, table), order


def test_every_prediction_carries_a_range_around_it(table: dict[str, validation.Prediction]) -> None:
    for p in table.values():
        assert p.tokens_low <= p.tokens <= p.tokens_high
        assert p.memory_low_gib <= p.memory_gib <= p.memory_high_gib
        assert p.dominant in {"compute", "bubble", "recompute"} or p.dominant.startswith("link ")


def test_megatron_core_h100_rows_are_priced_with_megatron_s_kernels_and_each_miss_is_explained(
        table: dict[str, validation.Prediction]) -> None:
    """Issue 43's Megatron-Core rows (the Megatron-LM README's H100 weak scaling): one fitted,
    the others checks, priced with Megatron's distributed optimizer, overlaps and
    sequence-parallel inputs. Not yet at issue 43's worst-case target: every miss beyond 10% is
    said in its direction (the PP 1 rows' traced to the data-parallel link their assumed
    microbatches leave exposed), none beyond 25%; every row, having trained, is priced as
    fitting (the 314B and 462B rows did not fit while the gathered inputs were priced whole)."""
    runs = {r["name"]: r for r in validation.load()["runs"] if r["source"] == "megatron-core-h100"}
    assert len(runs) == 9 and all(r["framework"] == "megatron" and r["overlapped_reduction"] for r in runs.values())
    priced = [table[n] for n in runs]
    assert sum(p.fitted for p in priced) == 1
    for p in priced:
        assert abs(p.error) <= 0.10 or p.explained.startswith("under" if p.error < 0 else "over"), p.name
        assert abs(p.error) <= 0.25, (p.name, p.error)
        assert p.memory_gib < 80e9 / 2**30, (p.name, p.memory_gib)


def test_fp8_rows_are_priced_from_the_fp8_peak_and_each_miss_is_explained(
        table: dict[str, validation.Prediction]) -> None:
    """Issue 43's FP8 rows (NeMo 24.07, Megatron-Bridge 25.09 / 25.11 on H100): nothing fitted on
    them; the blocks' linears at the FP8 peak with the recipe's casts, their inputs kept in FP8.
    Every row priced (each trained: each fits) within 15%, a miss beyond 10% said."""
    runs = {r["name"]: r for r in validation.load()["runs"] if r["precision"] == "fp8" and r.get("cp", 1) == 1}
    assert len(runs) == 9 and not any(r["fitted"] for r in runs.values())
    assert {r["fp8_recipe"] for r in runs.values()} == {"delayed", "current"}
    for name in runs:
        p = table[name]
        assert abs(p.error) <= 0.15, (p.name, p.error)
        assert abs(p.error) <= 0.10 or p.explained, (p.name, p.error)


def test_nvidia_recipes_bf16_gradients_are_declared_and_priced(table: dict[str, validation.Prediction]) -> None:
    """The Megatron rows whose recipe reduces gradients in bf16 say so, with the script that sets
    it, and each is a distributed-optimizer run (the only one priced that way)."""
    runs = [r for r in validation.load()["runs"] if r.get("grad_reduce_in_fp32") is False and r["framework"] == "megatron"]
    assert len(runs) == 11
    for r in runs:
        assert r["dp"] == "zero1" and r["framework"] == "megatron", r["name"]
        assert any("grad_reduce_in_fp32" in a and "scripts/performance" in a for a in r["assumed"]), r["name"]
        assert r["name"] in table


def test_context_parallel_rows_are_priced_as_a_ring_and_each_miss_is_explained(
        table: dict[str, validation.Prediction]) -> None:
    """Issue 43's CP 2 rows: nothing fitted on them. Each is priced (each trained: each fits)
    within issue 43's 20%, a miss beyond 10% said."""
    runs = {r["name"]: r for r in validation.load()["runs"] if r.get("cp", 1) > 1}
    assert len(runs) == 4 and not any(r["fitted"] for r in runs.values())
    for name in runs:
        p = table[name]
        assert abs(p.error) <= 0.20 and (abs(p.error) <= 0.10 or p.explained), (name, p.error)


def test_bloom_s_layout_sweep_predicts_every_fit_and_out_of_memory_outcome(table: dict[str, validation.Prediction]) -> None:
    """BLOOM's pre-training sweep (a 181B GPT on 384 A100, Megatron-DeepSpeed with ZeRO-1; the
    rows committed before they were priced, nothing fitted on them): priced with the memory
    unbounded, each layout's peak with the process's overheads says whether it fits an 80 GB
    A100, and that is right on all 17 (3 published out of memory). The throughput and memory
    are not at issue 43's targets: every row says so (its ``explained``), and the misses stay
    bounded (throughput within 50%, memory within 25%) so a change that widens them shows."""
    runs = {r["name"]: r for r in validation.load()["runs"] if r["source"] == "bigscience-prequel"}
    assert len(runs) == 17 and not any(r["fitted"] for r in runs.values())
    assert all(r["framework"] == "megatron-deepspeed" and r["dp"] == "zero1" for r in runs.values())
    priced = [table[n] for n in runs]
    assert sum(p.published_fits is False for p in priced) == 3
    for p in priced:
        assert p.fits == p.published_fits and p.needs_gib is not None, (p.name, p.needs_gib)
        assert (p.needs_gib <= device_profile("A100-80GB").memory_bytes / 2**30) == p.published_fits, (p.name, p.needs_gib)
        if p.published_fits:
            assert p.explained and abs(p.error) <= 0.50, (p.name, p.error)
            assert p.memory_error is not None and abs(p.memory_error) <= 0.25, (p.name, p.memory_error)
    s = validation.summary(list(table.values()), issue=43)
    assert (s["outcomes"], s["outcomes_right"], s["memory_rows"]) == (17, 17, 14)


def test_spearman_ranks_ties_by_their_mean_rank() -> None:
    assert validation.spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == 1.0
    assert validation.spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0
    assert validation.spearman([1.0, 1.0, 2.0], [5.0, 5.0, 9.0]) == 1.0


def test_every_sweep_of_unfitted_rows_is_ranked(table: dict[str, validation.Prediction]) -> None:
    """A sweep is one source's unfitted rows that trained on one model and cluster: zero bubble's
    schedules and microbatch counts on its 1.5B and 6.2B GPTs (issue 29) and BLOOM's layouts
    (issue 43). Each is ranked; the zero-bubble sweeps are ranked nearly as measured (neighbours
    swapped: two pairs in the 1.5B, one in the 6.2B), BLOOM's is not (issue 43's target 0.9, not met, said in RESULTS.md), and the
    check holds each where it is so a change that reorders one shows."""
    ranked = {(w.source, w.model): w for w in validation.sweeps(list(table.values()))}
    assert set(ranked) == {("zb", "zb-1.5b"), ("zb", "zb-6.2b"), ("bigscience-prequel", "bloom-prequel-181b")}
    bloom = ranked["bigscience-prequel", "bloom-prequel-181b"]
    assert (ranked["zb", "zb-1.5b"].rows, ranked["zb", "zb-6.2b"].rows, bloom.rows) == (5, 4, 14)
    assert ranked["zb", "zb-1.5b"].spearman >= 0.8 - 1e-9 and ranked["zb", "zb-6.2b"].spearman >= 0.8 - 1e-9
    assert -0.5 < bloom.spearman < 0.5
    assert validation.sweeps(list(table.values()), least=len(table) + 1) == []
