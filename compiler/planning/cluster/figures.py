"""The hardware and its links, resolved once: a cluster's GPUs and links and its device's per-op
model, at one end of the figures' range.

:func:`parse_cluster` reads ``nodes x gpus_per_node x device_profile`` into a
:class:`~pipecut.cluster.Cluster` (NVLink inside a node from the profile, the platform's
per-GPU network port between nodes, NCCL's bus bandwidth and latency on each from the family's
figures). :func:`figures_of` resolves the cluster with its device into :class:`Figures`: what a
GPU and each link cost, at the value or at either end of the figures' spread
(:class:`~pipecut.profile.hardware.FigureEnd`), for one framework
(:mod:`~pipecut.planning.cluster.frameworks`): its kernels' fitted fraction of peak prices the
products. Every step of the planner below takes that record; nothing below works the links, the
per-op model or the framework out again.
"""

from __future__ import annotations

import dataclasses
import re

from pipecut.cluster import Cluster, Link
from pipecut.core.kinds import AttentionKernel, Fp8Recipe, FrameworkKind
from pipecut.errors import InputError
from pipecut.planning.cluster.frameworks import Framework, Overlap, framework, kernels_figure
from pipecut.profile.devices import LINK_LATENCY_MS, DeviceProfile, Precision, device_profile
from pipecut.profile.hardware import (
    FigureEnd,
    HardwareModel,
    bus_link,
    family_figures,
    hardware_model,
)

__all__ = [
    "INTER_NODE_LATENCY_MS",
    "Figures",
    "cluster_at",
    "family_efficiency",
    "family_model",
    "figures_of",
    "parse_cluster",
]

INTER_NODE_LATENCY_MS = 0.02
"""20 µs per message between nodes: the order of NCCL's latency over InfiniBand."""

_SPEC = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*x\s*(.+?)\s*$", re.IGNORECASE)



@dataclasses.dataclass(frozen=True)
class Figures:
    """A cluster and its device, priced at one end of the figures' range: the record every
    step of the cluster planner takes."""

    cluster: Cluster
    """The GPUs and both links (bus bandwidth and latency at :attr:`end`)."""
    profile: DeviceProfile
    model: HardwareModel | None
    """The device's per-op model at bf16 at :attr:`end` (None: a family without hardware
    figures, priced by the roofline at :attr:`efficiency`)."""
    efficiency: float
    """The framework's kernels' fraction of dense peak a large product reaches in a run."""
    source: str
    """Where :attr:`efficiency` comes from and which framework it prices, for the plan's notes."""
    framework: Framework
    end: FigureEnd = FigureEnd.VALUE

    @property
    def tensor_overlapped(self) -> bool:
        """The framework hides each tensor-parallel collective under its product (async TP)."""
        return Overlap.TENSOR_PARALLEL in self.framework.overlaps

    def at(self, end: FigureEnd) -> Figures:
        """The same cluster, device and framework with every figure at ``end`` (the line rates kept)."""
        if end is self.end:
            return self
        model = family_model(self.profile, bound=end, framework_kind=self.framework.kind)
        return dataclasses.replace(self, cluster=cluster_at(self.cluster, self.profile, end), model=model, end=end)


def figures_of(cluster: str | Cluster, framework_kind: FrameworkKind = FrameworkKind.PIPECUT) -> Figures:
    """``cluster`` (text or a :class:`~pipecut.cluster.Cluster`) with its device resolved, at the
    figures' values, priced as ``framework_kind`` runs."""
    c = parse_cluster(cluster)
    profile = device_profile(c.device)
    efficiency, source = family_efficiency(profile, framework_kind)
    return Figures(cluster=c, profile=profile, model=family_model(profile, framework_kind=framework_kind),
                   efficiency=efficiency, source=source, framework=framework(framework_kind))


def parse_cluster(
    spec: str | Cluster, *, inter_bytes_per_s: float | None = None,
    inter_latency_ms: float = INTER_NODE_LATENCY_MS, intra_latency_ms: float = LINK_LATENCY_MS,
) -> Cluster:
    """``"8x8xH100-SXM"``: 8 nodes of 8 GPUs of the ``H100-SXM`` profile.

    Inside a node: the profile's NVLink (``link_bytes_per_s``); between nodes: ``inter_bytes_per_s``
    per GPU (default: the profile's ``network_bytes_per_s``)."""
    if isinstance(spec, Cluster):
        return spec
    match = _SPEC.match(str(spec))
    if match is None:
        raise InputError(
            f"cannot read cluster {spec!r}: write nodes x GPUs per node x device profile, e.g. "
            f"'8x8xH100-SXM' (64 GPUs); profiles: {_profile_names()}"
        )
    nodes, per_node, name = int(match[1]), int(match[2]), match[3]
    if nodes < 1 or per_node < 1:
        raise InputError(f"cluster {spec!r}: nodes and GPUs per node must be at least 1")
    profile = device_profile(name)
    network = inter_bytes_per_s if inter_bytes_per_s is not None else profile.network_bytes_per_s
    if network <= 0:
        if nodes > 1:
            raise InputError(
                f"cluster {spec!r}: the {profile.name} profile gives no inter-node bandwidth; pass "
                f"inter_bytes_per_s (e.g. 50e9 for 400 Gb/s InfiniBand per GPU)"
            )
        network = profile.link_bytes_per_s
    intra_bw, inter_bw = profile.link_bytes_per_s, network
    if _has_figures(profile):  # NCCL's bus bandwidth and latency on each link, from the figures
        intra_bw, intra_latency_ms = bus_link(intra_bw, profile.family, inter=False)
        inter_bw, inter_latency_ms = bus_link(inter_bw, profile.family, inter=True)
    return Cluster(
        nodes=nodes, gpus_per_node=per_node, device=profile.name,
        memory_bytes=profile.memory_bytes, peak_flops=profile.peak_flops(Precision.BF16),
        intra=Link(name=profile.interconnect, bandwidth_bytes_per_ms=intra_bw / 1e3,
                           latency_ms=intra_latency_ms),
        inter=Link(name=f"network {network * 8 / 1e9:g} Gb/s per GPU",
                           bandwidth_bytes_per_ms=inter_bw / 1e3, latency_ms=inter_latency_ms),
    )


def _has_figures(profile: DeviceProfile) -> bool:
    try:
        family_figures(profile.family)
    except InputError:
        return False
    return True


def _profile_names() -> list[str]:
    from pipecut.profile.devices import device_profiles

    return [p.name for p in device_profiles()]


def family_efficiency(profile: DeviceProfile, framework_kind: FrameworkKind = FrameworkKind.PIPECUT) -> tuple[float, str]:
    """(the fraction of dense peak a large product reaches in a run of ``framework_kind`` on the
    device's family, and where it was fitted, naming the framework), or the roofline's default for a
    family without hardware figures."""
    from pipecut.profile.devices import COMPUTE_EFFICIENCY

    priced = framework(framework_kind)
    if _has_figures(profile):
        fig, fitted_on = kernels_figure(priced.kernels, profile.family, framework_kind=priced.kind)
        return fig.value, (f"priced as {priced.kind.value} runs ({priced.kernels.value} kernels); per-op costs from the "
                           f"{profile.family} family's hardware figures; its products at {fig.value:g} of dense peak, "
                           f"fitted on {fitted_on}: {fig.source}")
    return COMPUTE_EFFICIENCY, (
        f"priced as {priced.kind.value} runs; compute efficiency {COMPUTE_EFFICIENCY:g}: no hardware figures and "
        f"no published run fitted for the {profile.family or profile.name} family"
    )


def family_model(profile: DeviceProfile, *, attention: AttentionKernel = AttentionKernel.FLASH,
                 bound: FigureEnd = FigureEnd.VALUE, residual: float | None = None,
                 framework_kind: FrameworkKind = FrameworkKind.PIPECUT, fp8_rows: frozenset[str] = frozenset(),
                 fp8_recipe: Fp8Recipe = Fp8Recipe.DELAYED) -> HardwareModel | None:
    """The per-op model of a device at bf16, its products at ``framework_kind``'s kernels' fraction
    of peak (``residual`` replaces it, for fitting), ``fp8_rows`` at the FP8 peak with
    ``fp8_recipe``'s casts; None for a family without hardware figures."""
    if not _has_figures(profile):
        return None
    if residual is None:
        residual = family_efficiency(profile, framework_kind)[0]
    fp8_peak = profile.peak_flops(Precision.FP8) if fp8_rows else 0.0
    return hardware_model(profile.peak_flops(Precision.BF16), profile.memory_bandwidth_bytes_per_s,
                          profile.family, residual=residual, attention=attention, bound=bound,
                          fp8_rows=fp8_rows, fp8_peak_flops=fp8_peak, fp8_recipe=fp8_recipe)


def cluster_at(cluster: Cluster, profile: DeviceProfile, bound: FigureEnd) -> Cluster:
    """``cluster`` with both links' bus bandwidth and latency at ``bound`` of the family's
    figures (the line rates kept)."""
    links = []
    for link, inter in ((cluster.intra, False), (cluster.inter, True)):
        line = link.bandwidth_bytes_per_ms * 1e3 / bus_link(1.0, profile.family, inter=inter)[0]
        bw, latency = bus_link(line, profile.family, inter=inter, bound=bound)
        links.append(dataclasses.replace(link, bandwidth_bytes_per_ms=bw / 1e3, latency_ms=latency))
    return dataclasses.replace(cluster, intra=links[0], inter=links[1])


