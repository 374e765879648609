"""The hardware and its links, resolved once: a cluster's GPUs and links and its device's per-op
model, at one end of the figures' range.

:func:`parse_cluster` reads ``nodes x gpus_per_node x device_profile`` into a
:class:`~pipecut.cluster.Cluster` (NVLink inside a node from the profile, the platform's
per-GPU network port between nodes, NCCL's bus bandwidth and latency on each from the family's
figures). :func:`figures_of` resolves the cluster with its device into :class:`Figures`: what a
GPU and each link cost, at the value or at either end of the figures' spread
(:class:`~pipecut.profile.hardware.FigureEnd`). Every step of the planner below takes that
record; nothing below works the links or the per-op model out again.
"""

from __future__ import annotations

import dataclasses
import re

from pipecut.cluster import Cluster, Link
from pipecut.core.kinds import AttentionKernel
from pipecut.errors import InputError
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
    """The family's residual (the fraction of dense peak a large product reaches in a run)."""
    source: str
    """Where :attr:`efficiency` comes from, for the plan's notes."""
    end: FigureEnd = FigureEnd.VALUE

    def at(self, end: FigureEnd) -> Figures:
        """The same cluster and device with every figure at ``end`` (the line rates kept)."""
        if end is self.end:
            return self
        model = family_model(self.profile, bound=end)
        return dataclasses.replace(self, cluster=cluster_at(self.cluster, self.profile, end), model=model, end=end)


def figures_of(cluster: str | Cluster) -> Figures:
    """``cluster`` (text or a :class:`~pipecut.cluster.Cluster`) with its device resolved, at the
    figures' values."""
    c = parse_cluster(cluster)
    profile = device_profile(c.device)
    efficiency, source = family_efficiency(profile)
    return Figures(cluster=c, profile=profile, model=family_model(profile), efficiency=efficiency, source=source)


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


def family_efficiency(profile: DeviceProfile) -> tuple[float, str]:
    """(the family's residual: the fraction of dense peak a large product reaches in a run, and
    where it was fitted), or the roofline's default for a family without hardware figures."""
    from pipecut.profile.devices import COMPUTE_EFFICIENCY

    if _has_figures(profile):
        fig = family_figures(profile.family)["residual"]
        return fig.value, (f"per-op costs from the {profile.family} family's hardware figures; residual "
                           f"{fig.value:g} of dense peak, {fig.source}")
    return COMPUTE_EFFICIENCY, (
        f"compute efficiency {COMPUTE_EFFICIENCY:g}: no published run fitted for the "
        f"{profile.family or profile.name} family"
    )


def family_model(profile: DeviceProfile, *, attention: AttentionKernel = AttentionKernel.FLASH,
                 bound: FigureEnd = FigureEnd.VALUE,
                 residual: float | None = None) -> HardwareModel | None:
    """The per-op model of a device at bf16 (None for a family without hardware figures)."""
    if not _has_figures(profile):
        return None
    return hardware_model(profile.peak_flops(Precision.BF16), profile.memory_bandwidth_bytes_per_s,
                          profile.family, residual=residual, attention=attention, bound=bound)


def cluster_at(cluster: Cluster, profile: DeviceProfile, bound: FigureEnd) -> Cluster:
    """``cluster`` with both links' bus bandwidth and latency at ``bound`` of the family's
    figures (the line rates kept)."""
    links = []
    for link, inter in ((cluster.intra, False), (cluster.inter, True)):
        line = link.bandwidth_bytes_per_ms * 1e3 / bus_link(1.0, profile.family, inter=inter)[0]
        bw, latency = bus_link(line, profile.family, inter=inter, bound=bound)
        links.append(dataclasses.replace(link, bandwidth_bytes_per_ms=bw / 1e3, latency_ms=latency))
    return dataclasses.replace(cluster, intra=links[0], inter=links[1])


