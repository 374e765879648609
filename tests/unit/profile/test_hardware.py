"""Every figure of the per-op cost model names its source, and the model prices by kernel."""

from __future__ import annotations

import dataclasses

import pytest

from pipecut.core.kinds import AttentionKernel, NodeOp
from pipecut.errors import InputError
from pipecut.ir import NodeCost
from pipecut.profile.flops import NodeWork
from pipecut.profile.hardware import all_figures, family_figures, gemm_efficiency, hardware_model


def test_every_figure_has_a_source_and_a_range_around_its_value() -> None:
    figures = list(all_figures())
    assert len(figures) > 20
    for name, fig in figures:
        assert len(fig.source.strip()) > 20, f"{name} has no source"
        assert fig.low <= fig.value <= fig.high, name


def test_the_hardware_figures_hold_no_engine_constant() -> None:
    """What a product reaches inside a run is a framework's kernels' figure (frameworks.json), not the
    hardware's: the hardware keeps what one product reaches alone."""
    for family in ("ampere", "hopper"):
        figs = family_figures(family)
        assert not any(name.startswith("residual") for name in figs), sorted(figs)
        assert 0.5 < figs["gemm_alone"].value < 1
        assert "fitted" not in figs["gemm_alone"].source


def test_tile_and_wave_quantization_cost_an_odd_shape() -> None:
    kw = dict(residual=0.7, tile_m=256, tile_n=128, sms=108)
    aligned = gemm_efficiency(256 * 108, 128, **kw)  # exactly one wave of whole tiles
    assert aligned == pytest.approx(0.7)
    assert gemm_efficiency(256 * 108 + 1, 128, **kw) < 0.36  # one tile more: a second, almost empty wave
    assert gemm_efficiency(256 * 108, 129, **kw) < 0.36  # a column past the tile: half the second tile idle


def test_attention_by_kernel_and_memory_bound_ops_by_bytes() -> None:
    hw = hardware_model(312e12, 2.039e12, "ampere", residual=0.666)
    slow = hardware_model(312e12, 2.039e12, "ampere", residual=0.666, attention=AttentionKernel.EFFICIENT)
    sdpa = NodeCost(name="a", op=NodeOp.CALL_FUNCTION, target="scaled_dot_product_attention", shape=(8, 2048, 4096))
    w = NodeWork(forward_flops=10**12, backward_flops=25 * 10**11, forward_bytes=10**8, backward_bytes=2 * 10**8)
    assert hw.node_ms(sdpa, w)[0] < slow.node_ms(sdpa, w)[0]
    add = NodeCost(name="b", op=NodeOp.CALL_FUNCTION, target="add", shape=(8, 2048, 4096))
    fwd, _ = hw.node_ms(add, NodeWork(forward_bytes=2 * 10**9, backward_bytes=4 * 10**9))
    launch = family_figures("ampere")["launch_us"].value * 1e-3
    frac = family_figures("ampere")["memory_bandwidth_fraction"].value
    assert fwd == pytest.approx(2e9 / (2.039e12 * frac) * 1e3 + launch)
    assert hw.node_ms(add, NodeWork(forward_bytes=8, backward_bytes=16))[0] == pytest.approx(launch, rel=1e-3)


def test_a_family_without_figures_is_refused_with_the_families_that_have_them() -> None:
    with pytest.raises(InputError, match="ampere"):
        family_figures("volta")


def test_a_bf16_product_with_an_unaligned_width_runs_at_the_misaligned_fraction() -> None:
    hw = hardware_model(989.5e12, 4.8e12, "hopper", residual=0.441)
    tokens, hidden = 8192, 1024

    def head(vocab: int, dtype: str) -> tuple[float, float]:
        row = NodeCost(name="lm_head", op=NodeOp.CALL_FUNCTION, target="torch.ops.aten.linear.default",
                       shape=(8, 1024, vocab), dtype=dtype)
        flops = 2 * tokens * hidden * vocab
        return hw.node_ms(row, NodeWork(forward_flops=flops, backward_flops=2 * flops,
                                        forward_bytes=2 * tokens * vocab, backward_bytes=4 * tokens * vocab))

    padded, odd = head(50304, "torch.bfloat16"), head(50257, "torch.bfloat16")
    factor = family_figures("hopper")["gemm_misaligned"].value
    # the same work within 0.1%, priced at the misaligned fraction of the rate, forward and backward
    assert odd[0] == pytest.approx(padded[0] / factor, rel=0.02)
    assert odd[1] == pytest.approx(padded[1] / factor, rel=0.02)
    # fp32 is not penalised (the factor was measured on bf16)
    assert head(50257, "torch.float32")[0] == pytest.approx(head(50304, "torch.float32")[0], rel=0.01)


def test_an_fp8_product_runs_at_the_fp8_peak_and_pays_its_recipe_s_casts() -> None:
    """A framework's FP8 linear: the FP8 dense peak times the bf16 efficiency times the family's
    fp8_gemm_vs_bf16, plus the casts (one bf16 read per cast under delayed scaling, two under
    current, then the FP8 copy and its transpose written), forward for the input and backward
    for the output's gradient."""
    from pipecut.core.kinds import Fp8Recipe

    row = NodeCost(name="up", op=NodeOp.CALL_FUNCTION, target="linear", shape=(8192, 16384), dtype="bfloat16")
    w = NodeWork(forward_flops=2 * 8192 * 4096 * 16384, backward_flops=4 * 8192 * 4096 * 16384)
    bf16 = hardware_model(989.5e12, 3.35e12, "hopper", residual=0.6)
    delayed = hardware_model(989.5e12, 3.35e12, "hopper", residual=0.6, fp8_rows=frozenset({"up"}),
                             fp8_peak_flops=1979e12)
    current = hardware_model(989.5e12, 3.35e12, "hopper", residual=0.6, fp8_rows=frozenset({"up"}),
                             fp8_peak_flops=1979e12, fp8_recipe=Fp8Recipe.CURRENT)
    ratio = family_figures("hopper")["fp8_gemm_vs_bf16"].value
    bw = 3.35e12 * family_figures("hopper")["memory_bandwidth_fraction"].value
    launch = family_figures("hopper")["launch_us"].value * 1e-3
    (f16, b16), (f8, b8), (fc, bc) = (m.node_ms(row, w) for m in (bf16, delayed, current))
    fwd_cast = (2 + 2) * 8192 * 4096 / bw * 1e3 + launch  # the input: one bf16 read, FP8 copy and transpose written
    assert f8 == pytest.approx((f16 - launch) / (2 * ratio) + launch + fwd_cast, rel=1e-6)
    assert b8 == pytest.approx((b16 - 2 * launch) / (2 * ratio) + 2 * launch + (2 + 2) * 8192 * 16384 / bw * 1e3 + launch,
                               rel=1e-6)
    assert fc - f8 == pytest.approx(2 * 8192 * 4096 / bw * 1e3) and bc > b8  # current scaling: a second read
    other = dataclasses.replace(row, name="head")
    assert delayed.node_ms(other, w) == bf16.node_ms(other, w)  # only the rows named run in FP8
    with pytest.raises(InputError, match="FP8 products on the ampere family need its fp8_gemm_vs_bf16"):
        hardware_model(312e12, 2.039e12, "ampere", residual=0.6, fp8_rows=frozenset({"up"}), fp8_peak_flops=624e12)
