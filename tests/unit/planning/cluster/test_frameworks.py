"""pipecut.planning.cluster.frameworks: every framework as data, apart from the hardware, each kernels
figure fitted on one named published run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipecut.core.kinds import FrameworkKind, KernelsKind, NodeOp
from pipecut.errors import InputError
from pipecut.ir import NodeCost
from pipecut.planning.cluster.foreign import RuntimeTerm
from pipecut.planning.cluster.frameworks import (
    FP8_SAVED_FRACTION,
    fp8_saved,
    framework,
    frameworks,
    kernels_figure,
)
from pipecut.profile.hardware import family_figures, memory_overheads

RUNS = Path(__file__).parents[4] / "benchmarks" / "validation_runs.json"


def test_every_framework_kind_is_in_the_data_with_its_kernels_and_terms() -> None:
    every = frameworks()
    assert [e.kind for e in every] == list(FrameworkKind)
    parts = set(memory_overheads(1.0))
    for e in every:
        assert isinstance(e.kernels, KernelsKind) and len(e.describes) > 40, e.kind
        assert all(isinstance(t, RuntimeTerm) for t in e.runtime_terms)
        assert set(e.memory_counts) <= parts, (e.kind, e.memory_counts)
    ours = framework(FrameworkKind.PIPECUT)
    assert ours.runtime_terms == () and ours.kernels is KernelsKind.EAGER and "never run on more" in ours.why_these_kernels
    assert framework("torchtitan").runtime_terms == (RuntimeTerm.LOSS_PARALLEL, RuntimeTerm.PIPELINE_KEEPS_OUTPUTS,
                                                  RuntimeTerm.PIPELINE_BUFFERS)


def test_each_kernels_figure_is_fitted_on_the_run_the_validation_split_names() -> None:
    """One constant per kernels and family, fitted on one declared run of a framework on those
    kernels, and below what one product reaches alone on that hardware."""
    data = json.loads(RUNS.read_text())
    split = {name for key, name in data["split"].items() if not key.startswith("declared")}
    runs = {r["name"]: r for r in data["runs"]}
    seen = set()
    for kernels in KernelsKind:
        for family in ("ampere", "hopper"):
            try:
                fig, fitted_on = kernels_figure(kernels, family)
            except InputError:
                continue
            seen.add(fitted_on)
            assert fitted_on in split and runs[fitted_on]["fitted"], (kernels, family, fitted_on)
            assert framework(runs[fitted_on]["framework"]).kernels is kernels, fitted_on
            assert fitted_on in fig.source and fig.low == fig.value == fig.high  # fitted: no spread
            assert 0.2 < fig.value < family_figures(family)["gemm_alone"].high, (kernels, family)
    assert seen == split


def test_an_unknown_engine_is_refused_with_the_engines() -> None:
    with pytest.raises(InputError, match=r"unknown framework 'deepspeed'; frameworks: \['pipecut', 'torchtitan'"):
        framework("deepspeed")
    with pytest.raises(InputError, match="no framework runs megatron kernels, and no published run on them is fitted "
                                         "for the volta family"):
        kernels_figure(KernelsKind.MEGATRON, "volta")


def test_only_megatron_s_linears_regather_sequence_parallel_inputs() -> None:
    """Megatron's column-parallel linears (Megatron-DeepSpeed's are Megatron-LM's) keep their
    input's shard and gather it again in the backward; pipecut's runtime and torchtitan run
    DTensor, whose autograd keeps the gathered copy."""
    assert {e.kind for e in frameworks() if e.regathers} == {FrameworkKind.MEGATRON, FrameworkKind.MEGATRON_DEEPSPEED}


def test_fp8_products_keep_their_inputs_in_fp8_and_nothing_else_changes() -> None:
    rows = (NodeCost(name="x", op=NodeOp.PLACEHOLDER, target="x", output_bytes=64),
            NodeCost(name="up", op=NodeOp.CALL_FUNCTION, target="linear", inputs=("x",), saved_bytes=64),
            NodeCost(name="act", op=NodeOp.CALL_FUNCTION, target="silu", inputs=("up",), saved_bytes=128),
            NodeCost(name="head", op=NodeOp.CALL_FUNCTION, target="linear", inputs=("act",), saved_bytes=64))
    got = {r.name: r for r in fp8_saved(rows, frozenset({"up"}))}
    assert got["up"].saved_bytes == 64 * FP8_SAVED_FRACTION == 32
    assert got["act"] == rows[2] and got["head"] == rows[3] and got["x"] == rows[0]
    assert fp8_saved(rows, frozenset()) == rows
    with pytest.raises(InputError, match=r"\['down'\] are not rows"):
        fp8_saved(rows, frozenset({"down"}))
