"""pipecut.planning.cluster.figures: clusters from text, and the cluster with its device resolved once."""

from __future__ import annotations

import pytest

from pipecut.core.kinds import FrameworkKind, KernelsKind
from pipecut.errors import InputError
from pipecut.planning.cluster.figures import (
    Figures,
    cluster_at,
    family_model,
    figures_of,
    parse_cluster,
)
from pipecut.planning.cluster.frameworks import kernels_figure
from pipecut.profile.hardware import FigureEnd, family_figures


def test_parse_cluster_reads_nodes_gpus_and_profile() -> None:
    c = parse_cluster("8x8xH100-SXM")
    assert (c.nodes, c.gpus_per_node, c.gpus, c.device) == (8, 8, 64, "H100-SXM")
    # the line rates (NVLink 4, 400 Gb/s per GPU) at the bus bandwidth NCCL reaches on them
    nvlink, network = (family_figures("hopper")[k].value for k in ("nvlink_bus_fraction", "network_bus_fraction"))
    assert c.intra.bandwidth_bytes_per_ms == pytest.approx(450e9 * nvlink / 1e3)
    assert c.inter.bandwidth_bytes_per_ms == pytest.approx(50e9 * network / 1e3)
    assert c.peak_flops == 989.5e12 and parse_cluster(c.spec) == c
    assert c.link_between(0, 7) is c.intra and c.link_between(7, 8) is c.inter
    assert c.ring_link((0, 1)) is c.intra and c.ring_link((0, 8)) is c.inter


@pytest.mark.parametrize(("spec", "match"), [
    ("8x8", "cannot read cluster '8x8': write nodes x GPUs per node x device profile"),
    ("0x8xH100-SXM", "at least 1"),
    ("2x8xNOPE", "no device profile named 'NOPE'"),
    ("2x1xL4", "gives no inter-node bandwidth; pass inter_bytes_per_s"),
])
def test_parse_cluster_errors(spec: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        parse_cluster(spec)


def test_gpu_outside_the_cluster_is_refused() -> None:
    with pytest.raises(InputError, match="GPU 4 is not in 1x4xA100-80GB"):
        parse_cluster("1x4xA100-80GB").node_of(4)


def test_figures_resolve_the_cluster_and_its_device_once_and_move_to_either_end() -> None:
    figures = figures_of("2x8xH100-SXM")
    assert isinstance(figures, Figures) and figures.end is FigureEnd.VALUE
    assert figures.cluster == parse_cluster("2x8xH100-SXM") and figures.profile.name == "H100-SXM"
    eager, fitted_on = kernels_figure(KernelsKind.EAGER, "hopper")
    assert figures.model is not None and figures.efficiency == eager.value  # pipecut's own: eager kernels
    assert "hopper" in figures.source and "priced as pipecut runs" in figures.source and fitted_on in figures.source
    assert figures.framework.kind is FrameworkKind.PIPECUT
    assert figures.at(FigureEnd.VALUE) is figures
    for end in (FigureEnd.FAST, FigureEnd.SLOW):
        moved = figures.at(end)
        # what the planner prices the chosen run on at each end: the links and the per-op model at that end
        assert moved.cluster == cluster_at(figures.cluster, figures.profile, end) and moved.end is end
        assert moved.model == family_model(figures.profile, bound=end)
        assert (moved.profile, moved.efficiency, moved.source, moved.framework) == (
            figures.profile, figures.efficiency, figures.source, figures.framework)
    fast, slow = figures.at(FigureEnd.FAST).cluster.inter, figures.at(FigureEnd.SLOW).cluster.inter
    assert fast.bandwidth_bytes_per_ms > slow.bandwidth_bytes_per_ms


def test_the_engine_prices_the_products_and_moves_with_the_figures() -> None:
    ours, megatron = figures_of("1x8xA100-80GB"), figures_of("1x8xA100-80GB", FrameworkKind.MEGATRON)
    assert megatron.efficiency == kernels_figure(KernelsKind.MEGATRON, "ampere")[0].value != ours.efficiency
    assert megatron.model is not None and ours.model is not None
    assert megatron.model.figures["residual"] == megatron.efficiency
    assert "priced as megatron runs (megatron kernels)" in megatron.source
    slow = megatron.at(FigureEnd.SLOW)
    assert slow.framework == megatron.framework and slow.model == family_model(
        megatron.profile, bound=FigureEnd.SLOW, framework_kind=FrameworkKind.MEGATRON)
    # the same hardware: only the products' fraction differs
    assert {k: v for k, v in megatron.model.figures.items() if k != "residual"} == {
        k: v for k, v in ours.model.figures.items() if k != "residual"}


def test_an_engine_without_a_fitted_run_on_the_family_is_refused_by_name() -> None:
    with pytest.raises(InputError, match="framework 'torchtitan-compile-float8' runs compiled-float8 kernels, and no "
                                         "published run on them is fitted for the ampere family"):
        figures_of("1x8xA100-80GB", FrameworkKind.TORCHTITAN_COMPILE_FLOAT8)


def test_a_family_without_figures_has_no_per_op_model() -> None:
    figures = figures_of("1x1xL4")
    assert figures.model is None and "no published run fitted" in figures.source
