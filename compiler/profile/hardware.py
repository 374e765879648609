"""A per-op cost model from the hardware's own figures, each with its source.

The figures live in ``hardware_figures.json`` beside the device profiles, per device family, each
as ``{value, low, high, source}``. A node's time is priced by what kind of kernel it is:

* **Matrix products** (linear, matmul, bmm, conv): ``flops / (peak · efficiency)`` with an
  efficiency by shape: the residual (what a large, aligned product reaches in a real run; the
  training framework's kernels' figure, given by the caller from ``frameworks.json``)
  times the *tile quantization* (the output padded to whole ``tile_m × tile_n`` tiles) times the
  *wave quantization* (the tiles padded to whole waves over the SMs), bounded below by the
  roofline's memory time; a 2-byte product whose inner or output size is not a multiple of 8
  runs at the family's ``gemm_misaligned`` fraction of that (measured on an H200: 0.13-0.17). Backward is two products (input and weight gradients), each with its
  own shape.
* **Attention** (SDPA): by kernel, flash or memory-efficient, with its own forward and backward
  efficiency relative to a large product. Eager attention is not one node: its score products
  and softmax are priced as products and memory-bound ops.
* **Memory-bound ops**: ``bytes / (HBM bandwidth · achievable fraction)``.
* **Launch overhead**: every kernel costs at least ``launch_us`` (one forward kernel, two
  backward ones per node that has a backward).
* **FP8 products** (a framework's, ``fp8_rows``): at the FP8 dense peak times the product's bf16
  efficiency times ``fp8_gemm_vs_bf16`` (what an FP8 product reaches alone against a bf16 one,
  from a published kernel benchmark), plus the scaling recipe's casts as memory-bound work
  (:class:`~pipecut.core.kinds.Fp8Recipe`).

:func:`bus_link` turns a link's line rate into the bus bandwidth NCCL reaches on it, with the
family's latency. :func:`memory_overheads` gives what a published peak counts beyond tensors:
the CUDA context, NCCL's buffers and the caching allocator's reserve.

``bound`` (a :class:`FigureEnd`) picks the figures: ``VALUE`` (the prediction), ``FAST`` (each
figure at the end of its range that makes the step shorter) or ``SLOW`` (the other end); the
residual stays at its fitted value in all three. ``gemm_alone`` (what one large product reaches
alone, the hardware's side of the residual) is a reference no price reads. A prediction's range is the fast and slow steps.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources

from pipecut.core.kinds import AttentionKernel, CostSource, Fp8Recipe, KernelKind
from pipecut.errors import InputError
from pipecut.ir import NodeCost
from pipecut.profile.flops import NodeWork

__all__ = [
    "Figure",
    "FigureEnd",
    "HardwareModel",
    "aligned",
    "all_figures",
    "bus_link",
    "family_figures",
    "gemm_efficiency",
    "hardware_model",
    "kernel_kind",
    "memory_overheads",
]



class FigureEnd(enum.Enum):
    """Which end of each figure's range a model is priced at."""

    VALUE = "value"
    """The figure itself: the prediction."""
    FAST = "fast"
    """Each figure at the end of its range that makes the step shorter (or memory smaller)."""
    SLOW = "slow"
    """The other end."""

_FASTER_WHEN_HIGH = {
    "residual", "gemm_alone", "fp8_gemm_vs_bf16", "attention_flash_forward", "attention_flash_backward", "attention_efficient_forward",
    "attention_efficient_backward", "memory_bandwidth_fraction", "nvlink_bus_fraction",
    "network_bus_fraction", "tile_m", "sm_count", "tile_n", "gemm_misaligned",
}
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    value: float
    low: float
    high: float
    source: str

    def at(self, bound: FigureEnd, faster_when_high: bool) -> float:
        if bound is FigureEnd.VALUE:
            return self.value
        fast = self.high if faster_when_high else self.low
        slow = self.low if faster_when_high else self.high
        return fast if bound is FigureEnd.FAST else slow


@functools.cache
def _load() -> dict[str, dict[str, dict[str, Figure]]]:
    raw = json.loads(resources.files("pipecut").joinpath("hardware_figures.json").read_text())

    def figs(d: Mapping[str, Mapping[str, object]]) -> dict[str, Figure]:
        return {k: Figure(value=float(v["value"]), low=float(v["low"]), high=float(v["high"]),  # type: ignore[arg-type]
                          source=str(v.get("source", ""))) for k, v in d.items()}

    return {"families": {f: figs(d) for f, d in raw["families"].items()}, "memory": {"": figs(raw["memory"])}}


def family_figures(family: str) -> dict[str, Figure]:
    """The figures of one device family ("ampere", "hopper"); InputError for one without figures."""
    fams = _load()["families"]
    if family not in fams:
        raise InputError(f"no hardware figures for the {family or 'unnamed'} family; families with "
                         f"figures: {sorted(fams)}")
    return fams[family]


def all_figures() -> Iterator[tuple[str, Figure]]:
    """Every figure, named ``family.name`` or ``memory.name`` (for the test that each has a source)."""
    for fam, figs in _load()["families"].items():
        for name, fig in figs.items():
            yield f"{fam}.{name}", fig
    for name, fig in _load()["memory"][""].items():
        yield f"memory.{name}", fig


def kernel_kind(target: str, forward_flops: int) -> KernelKind:
    """How a node of ``target`` with ``forward_flops`` is priced."""
    t = target.lower()
    if any(a in t for a in _ATTENTION):
        return KernelKind.ATTENTION
    elementwise = ("embedding", "loss", "entropy", "softmax", "norm")
    return KernelKind.GEMM if forward_flops > 0 and not any(e in t for e in elementwise) else KernelKind.MEMORY


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareModel:
    """The figures one prediction prices with: a device's peaks and its family's figures at one
    bound, plus the attention kernel the run uses."""

    peak_flops: float
    memory_bandwidth: float
    figures: Mapping[str, float]
    attention: AttentionKernel = AttentionKernel.FLASH
    """The SDPA backend (eager attention is separate nodes)."""
    causal: bool = True
    """Attention is causal: the fused kernels skip the masked half of the token pairs, which
    torch's FLOP counter counts in full (``sdpa_flop_count`` ignores ``is_causal``)."""
    fp8_rows: frozenset[str] = frozenset()
    """The products a framework runs in FP8 (Transformer Engine's linears): each at
    :attr:`fp8_peak_flops` times its bf16 efficiency times the family's ``fp8_gemm_vs_bf16``,
    plus the recipe's casts (:meth:`fp8_cast_bytes`)."""
    fp8_peak_flops: float = 0.0
    fp8_recipe: Fp8Recipe = Fp8Recipe.DELAYED

    def _f(self, name: str) -> float:
        return self.figures[name]

    def price(self, rows: tuple[NodeCost, ...], work: Mapping[str, NodeWork]) -> tuple[NodeCost, ...]:
        """Every row's forward and backward ms from this model; rows marked estimated."""
        out = []
        for row in rows:
            fwd, bwd = self.node_ms(row, work.get(row.name, NodeWork()))
            out.append(dataclasses.replace(row, forward_ms=fwd, backward_ms=bwd, source=CostSource.ESTIMATED))
        return tuple(out)

    def node_ms(self, row: NodeCost, w: NodeWork) -> tuple[float, float]:
        if w.forward_flops == 0 and w.forward_bytes == 0 and w.backward_bytes == 0 and w.backward_flops == 0:
            return 0.0, 0.0
        launch = self._f("launch_us") * 1e-3
        bw = self.memory_bandwidth * self._f("memory_bandwidth_fraction")
        kind = kernel_kind(str(row.target), w.forward_flops)
        mem_f, mem_b = w.forward_bytes / bw * 1e3, w.backward_bytes / bw * 1e3
        bwd_launch = 2 * launch if (w.backward_flops or w.backward_bytes) else 0.0
        if kind is KernelKind.ATTENTION:
            key = self.attention.value
            ef = self._f("residual") * self._f(f"attention_{key}_forward")
            eb = self._f("residual") * self._f(f"attention_{key}_backward")
            done = 0.5 if self.causal else 1.0
            fwd = max(done * w.forward_flops / (self.peak_flops * ef) * 1e3, mem_f) + launch
            bwd = max(done * w.backward_flops / (self.peak_flops * eb) * 1e3, mem_b) + bwd_launch
            return fwd, bwd
        if kind is KernelKind.GEMM:
            batch, m, n = _gemm_dims(row, w)
            k = max(1, round(w.forward_flops / (2 * batch * m * n))) if batch * m * n else 1
            rate = self.peak_flops * (1.0 if aligned(n, k, row.dtype) else self._f("gemm_misaligned"))
            casts = (0.0, 0.0)
            if row.name in self.fp8_rows:  # at the FP8 peak, the bf16 alignment penalty kept
                rate = self.fp8_peak_flops * self._f("fp8_gemm_vs_bf16") * rate / self.peak_flops
                fwd_cast, bwd_cast = self.fp8_cast_bytes(batch * m * k, batch * m * n)
                casts = (fwd_cast / bw * 1e3 + launch, bwd_cast / bw * 1e3 + launch)
            fwd = max(w.forward_flops / (rate * self.gemm_efficiency(m, n, batch)) * 1e3, mem_f) + launch
            half = w.backward_flops / 2
            grad = half / (rate * self.gemm_efficiency(m, k, batch)) + half / (rate * self.gemm_efficiency(k, n, batch))
            bwd = max(grad * 1e3, mem_b) + bwd_launch
            return fwd + casts[0], bwd + casts[1]
        # memory-bound (elementwise, norms, softmax, embedding lookup, loss): bytes at HBM speed
        comp = self.peak_flops * self._f("residual")
        return (max(mem_f, w.forward_flops / comp * 1e3) + launch,
                max(mem_b, w.backward_flops / comp * 1e3) + bwd_launch)

    def fp8_cast_bytes(self, inputs: int, outputs: int) -> tuple[float, float]:
        """HBM bytes an FP8 product's casts move beyond the product (forward, backward), for a
        product of ``inputs`` input and ``outputs`` output elements: its bf16 input cast to FP8
        (read once under delayed scaling, twice under current: Transformer Engine's docs, 'FP8
        Delayed Scaling') and written with its transpose for the weight gradient, and in
        backward the same for the output's gradient. The weight's FP8 copy is made once a step
        and kept over the microbatches (Transformer Engine's ``is_first_microbatch``): not
        counted per microbatch."""
        reads = 2 if self.fp8_recipe is Fp8Recipe.CURRENT else 1
        per = 2 * reads + 2  # bf16 read(s), then the FP8 copy and its transpose written
        return float(per * inputs), float(per * outputs)

    def gemm_efficiency(self, m: int, n: int, batch: int = 1) -> float:
        return gemm_efficiency(m, n, batch, residual=self._f("residual"), tile_m=int(self._f("tile_m")),
                               tile_n=int(self._f("tile_n")), sms=int(self._f("sm_count")))


def gemm_efficiency(m: int, n: int, batch: int = 1, *, residual: float, tile_m: int, tile_n: int,
                    sms: int) -> float:
    """Fraction of dense peak of a ``batch × (m × n)`` product: the residual times tile
    quantization (``m·n`` over whole tiles) times wave quantization (tiles over whole waves).

    >>> round(gemm_efficiency(16384, 4096, residual=0.75, tile_m=256, tile_n=128, sms=108), 3)
    0.749
    """
    m, n, batch = max(1, m), max(1, n), max(1, batch)
    tm, tn = math.ceil(m / tile_m), math.ceil(n / tile_n)
    tile = (m * n) / (tm * tile_m * tn * tile_n)
    tiles = batch * tm * tn
    wave = tiles / (math.ceil(tiles / sms) * sms)
    return residual * tile * wave


def aligned(n: int, k: int, dtype: str | None) -> bool:
    """Whether a product's output width ``n`` and inner size ``k`` (the leading dimensions of its
    row-major operands, forward and backward) are whole 16-byte units for a 2-byte ``dtype``:
    the alignment cuBLAS's fast Tensor Core kernels need. Other dtypes count as aligned (the
    penalty was measured on bf16 only).

    >>> aligned(50304, 1024, "torch.bfloat16"), aligned(50257, 1024, "torch.bfloat16")
    (True, False)
    """
    name = str(dtype or "").removeprefix("torch.")
    if name not in {"bfloat16", "float16", "half"}:
        return True
    return n % 8 == 0 and k % 8 == 0


def _gemm_dims(row: NodeCost, w: NodeWork) -> tuple[int, int, int]:
    """(batch, m, n) of a product's output: a linear flattens its leading dims into m; a batched
    product keeps them as the batch."""
    shape = tuple(int(s) for s in (row.shape or ()))
    if not shape:
        return 1, 1 << 14, 1 << 14  # unknown: a large product
    if len(shape) == 1:
        return 1, 1, shape[0]
    if "linear" in str(row.target).lower() or "addmm" in str(row.target).lower() or len(shape) == 2:
        return 1, math.prod(shape[:-1]), shape[-1]
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def hardware_model(peak_flops: float, memory_bandwidth: float, family: str, *, residual: float,
                   attention: AttentionKernel = AttentionKernel.FLASH, bound: FigureEnd = FigureEnd.VALUE,
                   causal: bool = True, fp8_rows: frozenset[str] = frozenset(), fp8_peak_flops: float = 0.0,
                   fp8_recipe: Fp8Recipe = Fp8Recipe.DELAYED) -> HardwareModel:
    """The model of a device (its dense peak at the run's precision and its HBM bandwidth) with its
    family's figures at ``bound``, its products at ``residual`` of the peak: the fraction a large
    product reaches inside a run, which is the training framework's kernels' figure
    (:mod:`pipecut.planning.cluster.frameworks`), not the hardware's."""
    figs = {k: f.at(bound, k in _FASTER_WHEN_HIGH) for k, f in family_figures(family).items()}
    figs["residual"] = residual
    if fp8_rows and ("fp8_gemm_vs_bf16" not in figs or fp8_peak_flops <= 0):
        raise InputError(f"FP8 products on the {family} family need its fp8_gemm_vs_bf16 figure and an FP8 peak "
                         f"in the device profile; families with it: "
                         f"{sorted(f for f, v in _load()['families'].items() if 'fp8_gemm_vs_bf16' in v)}")
    return HardwareModel(peak_flops=peak_flops, memory_bandwidth=memory_bandwidth, figures=figs,
                         attention=attention, causal=causal, fp8_rows=fp8_rows, fp8_peak_flops=fp8_peak_flops,
                         fp8_recipe=fp8_recipe)


def bus_link(line_bytes_per_s: float, family: str, *, inter: bool,
             bound: FigureEnd = FigureEnd.VALUE) -> tuple[float, float]:
    """(bus bytes/s NCCL reaches, latency ms) on a link of ``line_bytes_per_s`` per direction:
    NVLink inside a node, the network between nodes."""
    figs = family_figures(family)
    frac = figs["network_bus_fraction" if inter else "nvlink_bus_fraction"]
    lat = figs["inter_latency_us" if inter else "intra_latency_us"]
    return line_bytes_per_s * frac.at(bound, True), lat.at(bound, False) * 1e-3


def memory_overheads(peak_tensor_bytes: float, *, bound: FigureEnd = FigureEnd.VALUE) -> dict[str, float]:
    """Bytes a published peak may count beyond the tensors: ``context`` (CUDA context),
    ``nccl`` (NCCL's buffers) and ``fragmentation`` (the caching allocator's reserve above the
    tensors, a fraction of them)."""
    figs = _load()["memory"][""]
    gib = 2**30
    pick = lambda f: f.at(bound, faster_when_high=False)  # noqa: E731 - more memory is the slow side
    return {
        "context": pick(figs["cuda_context_gib"]) * gib,
        "nccl": pick(figs["nccl_buffers_gib"]) * gib,
        "fragmentation": pick(figs["allocator_fragmentation"]) * peak_tensor_bytes,
    }
