"""Plan for devices that are not here: cost tables estimated from FLOPs, bytes and a device profile.

Profiles of common GPUs ship as data (``device_profiles.json``): nominal datasheet peaks, not
measurements. A node's estimated time is the roofline

    time = max(flops / (peak_flops · compute_efficiency), bytes / (bandwidth · memory_efficiency))

with FLOPs and bytes counted per node by :mod:`pipecut.profile.flops`. The rows of the cost table are
marked ``CostSource.ESTIMATED`` so a plan says which times were measured and which were not.
Every profile is a GPU's (NVIDIA's and AMD's, whose PyTorch builds take CUDA's kernels): the saved
bytes counted here are those a GPU keeps, not those of the CPU that counts them
(:class:`~pipecut.profile.saved.GpuDropout`)::

    nodes = pipecut.estimate_costs(model, (x,), device="A100-80GB", microbatches=8,
                                   loss_fn=loss_fn, target=y)
    plan = partition_costs(nodes, devices=device_specs("A100-80GB", 8),
                           link=device_link("A100-80GB"), microbatches=8, batch_size=len(x))
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from pipecut.capture import capture_as
from pipecut.cluster import LINK_LATENCY_MS, Link
from pipecut.core.batching import batch_size, split_microbatches
from pipecut.core.kinds import CostSource
from pipecut.core.program import Captured, Inputs
from pipecut.core.torch_private import pytree
from pipecut.errors import InputError
from pipecut.ir import DeviceSpec, NodeCost
from pipecut.options import CaptureOptions
from pipecut.profile.fake import fake_work
from pipecut.profile.flops import NodeWork, count_work
from pipecut.profile.nodes import LossFn, profile
from pipecut.profile.saved import GpuDropout

__all__ = [
    "COMPUTE_EFFICIENCY",
    "LINK_LATENCY_MS",
    "MEMORY_EFFICIENCY",
    "DeviceProfile",
    "Precision",
    "count_captured",
    "count_costs",
    "device_link",
    "device_profile",
    "device_profiles",
    "device_specs",
    "estimate_captured",
    "estimate_costs",
    "estimate_rows",
    "estimate_table",
    "roofline_ms",
]

COMPUTE_EFFICIENCY = 0.6
"""Fraction of peak FLOP/s a large matrix product reaches (typical of cuBLAS on big shapes)."""
MEMORY_EFFICIENCY = 0.8
"""Fraction of peak memory bandwidth a streaming elementwise kernel reaches."""
"""10 µs per message: the order of NCCL point-to-point latency inside a node."""


class Precision(enum.Enum):
    FP32 = "fp32"
    TF32 = "tf32"
    """FP32 storage, matrix products on TF32 tensor cores."""
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    """Dense FP8 (E4M3/E5M2) tensor-core products: priced only for a framework's FP8 linears
    (:class:`~pipecut.profile.hardware.HardwareModel`'s ``fp8_rows``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """Nominal figures of one device model (see ``datasheet`` for where they come from)."""

    name: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    flops: tuple[tuple[Precision, float], ...]
    """Peak dense FLOP/s per precision the device supports."""
    interconnect: str
    link_bytes_per_s: float
    """Device-to-device bandwidth per direction (NVLink or PCIe)."""
    datasheet: str
    family: str = ""
    """Architecture ("ampere", "hopper", "blackwell", "cdna3"): devices of one family share a
    fitted compute efficiency (see :mod:`pipecut.planning.cluster.plan`)."""
    network_bytes_per_s: float = 0.0
    """Inter-node bandwidth of one GPU's network port per direction, as the platform's reference
    design ships it (0: not given); the default of a cluster of these devices."""

    def peak_flops(self, precision: Precision) -> float:
        for p, value in self.flops:
            if p is precision:
                return value
        valid = [p.value for p, _ in self.flops]
        raise InputError(
            f"{self.name} has no {precision.value} peak in its profile; choose one of {valid}"
        )


@functools.cache
def _load() -> tuple[DeviceProfile, ...]:
    text = resources.files("pipecut").joinpath("device_profiles.json").read_text()
    out = []
    for d in json.loads(text)["devices"]:
        out.append(DeviceProfile(
            name=d["name"],
            memory_bytes=int(d["memory_bytes"]),
            memory_bandwidth_bytes_per_s=float(d["memory_bandwidth_bytes_per_s"]),
            flops=tuple((Precision(k), float(v)) for k, v in d["flops"].items() if v is not None),
            interconnect=d["interconnect"],
            link_bytes_per_s=float(d["link_bytes_per_s"]),
            datasheet=d["datasheet"],
            family=d.get("family", ""),
            network_bytes_per_s=float(d.get("network_bytes_per_s", 0.0)),
        ))
    return tuple(out)


def device_profiles() -> tuple[DeviceProfile, ...]:
    """Every shipped profile."""
    return _load()


def device_profile(name: str | DeviceProfile) -> DeviceProfile:
    if isinstance(name, DeviceProfile):
        return name
    for p in _load():
        if p.name.lower() == name.lower():
            return p
    raise InputError(
        f"no device profile named {name!r}; choose one of {[p.name for p in _load()]} or pass "
        f"a DeviceProfile"
    )


def device_specs(name: str | DeviceProfile, count: int) -> tuple[DeviceSpec, ...]:
    """``count`` devices of a profile, with its memory capacity, for ``partition_costs``."""
    p = device_profile(name)
    return tuple(DeviceSpec(name=p.name, memory_bytes=p.memory_bytes) for _ in range(count))


def device_link(name: str | DeviceProfile, latency_ms: float = LINK_LATENCY_MS) -> Link:
    """The profile's interconnect as a :class:`Link` (not measured)."""
    p = device_profile(name)
    return Link(bandwidth_bytes_per_ms=p.link_bytes_per_s / 1e3, latency_ms=latency_ms, measured=False)


def roofline_ms(
    flops: float, nbytes: float, profile: DeviceProfile, precision: Precision, *,
    compute_efficiency: float = COMPUTE_EFFICIENCY, memory_efficiency: float = MEMORY_EFFICIENCY,
) -> float:
    compute = flops / (profile.peak_flops(precision) * compute_efficiency)
    memory = nbytes / (profile.memory_bandwidth_bytes_per_s * memory_efficiency)
    return max(compute, memory) * 1e3


def estimate_rows(
    rows: tuple[NodeCost, ...], work: Mapping[str, NodeWork], profile: DeviceProfile,
    precision: Precision, *, compute_efficiency: float = COMPUTE_EFFICIENCY,
    memory_efficiency: float = MEMORY_EFFICIENCY, cost_model: Any = None,
) -> tuple[NodeCost, ...]:
    """Replace the times of a cost table by roofline estimates; mark the rows estimated.
    ``cost_model``: a :class:`pipecut.profile.hardware.HardwareModel` prices every node by its
    kernel instead (the cluster path's model; the efficiencies above are then unused)."""
    if cost_model is not None:
        return cost_model.price(rows, work)  # type: ignore[no-any-return]
    kw: dict[str, Any] = dict(
        compute_efficiency=compute_efficiency, memory_efficiency=memory_efficiency
    )
    out = []
    for row in rows:
        w = work.get(row.name, NodeWork())
        out.append(dataclasses.replace(
            row,
            forward_ms=roofline_ms(w.forward_flops, w.forward_bytes, profile, precision, **kw),
            backward_ms=roofline_ms(w.backward_flops, w.backward_bytes, profile, precision, **kw),
            source=CostSource.ESTIMATED,
        ))
    return tuple(out)


def _precision(model: torch.nn.Module) -> Precision:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {torch.bfloat16: Precision.BF16, torch.float16: Precision.FP16}.get(dtype, Precision.FP32)


def _own(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return x.detach().clone(memory_format=torch.contiguous_format).requires_grad_(x.requires_grad)
    return x


def count_costs(
    captured: Captured, inputs: Sequence[Any], *, loss_fn: LossFn | None = None, target: Any = None,
    real: bool = False, gpu: bool = False,
) -> tuple[tuple[NodeCost, ...], dict[str, NodeWork]]:
    """Rows (shapes, output, parameter and saved bytes; times not estimated yet) and the FLOPs and
    bytes of every node on flat placeholder ``inputs`` of one microbatch: on fake tensors
    (:func:`~pipecut.profile.fake.fake_work`), or with ``real`` by running every node for real
    (:func:`~pipecut.profile.nodes.profile` once and
    :func:`~pipecut.profile.flops.count_work`: the reference the fake count must equal).
    ``gpu``: the saved bytes a GPU keeps where its kernels keep other tensors than the CPU's
    (:class:`~pipecut.profile.saved.GpuDropout`), on either path."""
    if not real:
        return fake_work(captured, inputs, loss_fn=loss_fn, target=target, gpu=gpu)
    # each microbatch in a storage of its own, as a stage gets it (not a view of the batch)
    inputs, target = pytree.tree_map(_own, (list(inputs), target))
    with GpuDropout() if gpu else contextlib.nullcontext():
        rows = profile(captured, inputs, loss_fn=loss_fn, target=target, repeats=1, warmup=0)
        return rows, count_work(captured, inputs, loss_fn=loss_fn, target=target)


def estimate_table(
    captured: Captured, inputs: Sequence[Any], device: str | DeviceProfile, *,
    loss_fn: LossFn | None = None, target: Any = None,
) -> tuple[NodeCost, ...]:
    """``captured``'s cost table on flat placeholder ``inputs`` of one microbatch with every time
    estimated for ``device`` (counted on fake tensors: no arithmetic, no clock), at the precision
    of the graph's parameters: what ``MeasureOptions(estimate=...)`` plans with. Every profile is
    a GPU's: the saved bytes are those it keeps (``count_costs(gpu=True)``)."""
    rows, work = count_costs(captured, inputs, loss_fn=loss_fn, target=target, gpu=True)
    return estimate_rows(rows, work, device_profile(device), _precision(captured.gm))


def estimate_costs(
    model: torch.nn.Module,
    example_inputs: Inputs,
    device: str | DeviceProfile = "A100-80GB",
    *,
    precision: Precision | str | None = None,
    microbatches: int = 1,
    loss_fn: LossFn | None = None,
    target: Any = None,
    compute_efficiency: float = COMPUTE_EFFICIENCY,
    memory_efficiency: float = MEMORY_EFFICIENCY,
    real: bool = False,
    cost_model: Any = None,
    capture: CaptureOptions | None = None,
) -> tuple[NodeCost, ...]:
    """Cost table of ``model`` on one microbatch, with times estimated for ``device``.

    The model (real, or built on the meta device) is captured here and its nodes' shapes,
    FLOPs, bytes and saved bytes are counted on fake tensors (:mod:`pipecut.profile.fake`): no
    arithmetic, no real tensor beyond the model's own, so a 405B model is estimated on a laptop.
    No time is measured. ``precision``: the arithmetic the device would use; default from the
    model's parameter dtype (float32 -> fp32; pass "tf32" for TF32 tensor cores). Bytes are
    those of the model's own dtypes: cast the model (``model.to(torch.bfloat16)``) to plan BF16.
    ``real``: count by running every node for real instead (the reference the fake count is
    tested against; slow, and a meta model's weights are made one node at a time).
    ``cost_model``: price the nodes with a per-op model
    (:class:`pipecut.profile.hardware.HardwareModel`) instead of the roofline. ``capture``: how
    the model is captured (default ``CaptureOptions()``: torch.export's symbolic shapes within
    its time bound; ``time_limit="unbounded"`` waits, so the graph does not depend on the
    machine's load).
    """
    return estimate_captured(
        model, example_inputs, device, precision=precision, microbatches=microbatches,
        loss_fn=loss_fn, target=target, compute_efficiency=compute_efficiency,
        memory_efficiency=memory_efficiency, real=real, cost_model=cost_model, capture=capture,
    )[1]


def estimate_captured(
    model: torch.nn.Module,
    example_inputs: Inputs,
    device: str | DeviceProfile = "A100-80GB",
    *,
    precision: Precision | str | None = None,
    microbatches: int = 1,
    loss_fn: LossFn | None = None,
    target: Any = None,
    compute_efficiency: float = COMPUTE_EFFICIENCY,
    memory_efficiency: float = MEMORY_EFFICIENCY,
    real: bool = False,
    cost_model: Any = None,
    capture: CaptureOptions | None = None,
) -> tuple[Captured, tuple[NodeCost, ...]]:
    """:func:`estimate_costs` and the capture it made (for the plan's fingerprint, without
    capturing a large model twice)."""
    prof = device_profile(device)
    whole = [p.value for p in Precision if p is not Precision.FP8]  # what every op of a model can run in
    try:
        prec = Precision(precision) if precision is not None else _precision(model)
    except ValueError:
        raise InputError(f"unknown precision {precision!r}; choose one of {whole}") from None
    if prec is Precision.FP8:
        raise InputError(
            "precision 'fp8' prices only a framework's FP8 linears (HardwareModel.fp8_rows, for published runs); "
            f"an estimate runs every op of the model in one precision: choose one of {whole}"
        )
    prof.peak_flops(prec)  # fail before running anything
    captured, rows, work = count_captured(model, example_inputs, microbatches=microbatches, loss_fn=loss_fn,
                                          target=target, real=real, capture=capture)
    return captured, estimate_rows(
        rows, work, prof, prec, compute_efficiency=compute_efficiency,
        memory_efficiency=memory_efficiency, cost_model=cost_model,
    )


def count_captured(
    model: torch.nn.Module, example_inputs: Inputs, *, microbatches: int = 1, loss_fn: LossFn | None = None,
    target: Any = None, real: bool = False, capture: CaptureOptions | None = None,
) -> tuple[Captured, tuple[NodeCost, ...], dict[str, NodeWork]]:
    """``model`` captured at the first of ``microbatches`` microbatches of ``example_inputs``, and
    its rows and work counted there (:func:`count_costs`, a GPU's saved bytes): every figure of a
    cost table but the times, which no device has priced yet."""
    if not isinstance(example_inputs, (tuple, list, Mapping)):
        raise InputError(
            f"example_inputs must be a tuple of positional tensors or a dict of keyword tensors, "
            f"got {type(example_inputs).__name__}; wrap a single tensor as (x,)"
        )
    size = batch_size(
        list(example_inputs.values()) if isinstance(example_inputs, Mapping) else example_inputs
    )
    first_inputs = split_microbatches(example_inputs, microbatches, size)[0]
    first_target = (
        split_microbatches(target, microbatches, size, "target")[0] if target is not None else None
    )
    captured = capture_as(model, first_inputs, capture or CaptureOptions())
    flat = captured.flatten_inputs(first_inputs)
    rows, work = count_costs(captured, flat, loss_fn=loss_fn, target=first_target, real=real, gpu=True)
    return captured, rows, work
