"""The framework a cluster prediction prices, as data: which kernels its products run on, what its
runtime holds beyond pipecut's own, and what its published memory figures count.

The hardware (``hardware_figures.json``, :mod:`pipecut.profile.hardware`) says what a GPU and its
links can do. ``frameworks.json`` says what a framework does with them:

* **kernels** (:class:`~pipecut.core.kinds.KernelsKind`): per device family, the one constant
  fitted end to end, the fraction of the dense bf16 peak a large product reaches inside a run on
  those kernels. It belongs to the kernels, so frameworks that run the same kernels share it.
* **frameworks** (:class:`~pipecut.core.kinds.FrameworkKind`): the kernels, the runtime's own
  memory (:class:`~pipecut.planning.cluster.foreign.RuntimeTerm`), what its memory figure counts
  beyond tensors (parts of :func:`pipecut.profile.hardware.memory_overheads`), its ZeRO-1, what
  it keeps of sequence parallelism's gathered inputs, and the communication it can overlap
  (:class:`Overlap`).
* **FP8 activations** (:func:`fp8_saved`): what a run's FP8 products keep for their backward.

A prediction names its framework (``RunPrediction.framework``); a framework whose kernels have no
figure for a family is refused there, by name, rather than priced with another's.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
from collections.abc import Sequence
from importlib import resources
from typing import Any

from pipecut.core.kinds import FrameworkKind, KernelsKind
from pipecut.errors import InputError
from pipecut.ir import NodeCost
from pipecut.planning.cluster.foreign import RuntimeTerm
from pipecut.profile.hardware import Figure

__all__ = ["FP8_SAVED_FRACTION", "Framework", "Overlap", "fp8_saved", "framework", "frameworks", "kernels_figure"]

FP8_SAVED_FRACTION = 0.5
"""What an FP8 linear keeps of its input for the weight gradient, against a bf16 one: its FP8
copy, one byte an element instead of two (Transformer Engine casts the input once for the
forward product and saves that cast, not the bf16 tensor)."""


class Overlap(enum.Enum):
    """Communication a framework can hide under compute, where a run asks for it."""

    TENSOR_PARALLEL = "tensor-parallel"
    """Async tensor parallelism: each tensor-parallel collective under its product."""
    DATA_PARALLEL = "data-parallel"
    """The replicas' gradient reduction under the backward (``RunShape.overlapped_reduction``)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Framework:
    """One framework of ``frameworks.json``."""

    kind: FrameworkKind
    kernels: KernelsKind
    """The kernels its products run on: their figure prices its compute."""
    describes: str
    runtime_terms: tuple[RuntimeTerm, ...] = ()
    """What its runtime holds that pipecut's does not (each sized from the workload's shapes)."""
    memory_counts: tuple[str, ...] = ()
    """What its published per-GPU memory counts beyond tensors (``memory_overheads``' parts)."""
    why_these_kernels: str = ""
    overlaps: tuple[Overlap, ...] = ()
    """What it can hide under compute; pipecut's own runtime: nothing."""
    distributed_optimizer: bool = False
    """Its ZeRO-1 is Megatron's distributed optimizer (``RunShape.distributed_optimizer``), not
    torch's ``ZeroRedundancyOptimizer``."""
    regathers: bool = False
    """With sequence parallelism, its column products keep their input's shard and gather it
    again in the backward (Megatron's, Transformer Engine's), rather than keeping the gathered
    copy as autograd does over DTensor's redistribute
    (:func:`~pipecut.passes.parallel.tensor.shard_table`'s ``regather``)."""

    def run_terms(self) -> dict[str, Any]:
        """The :class:`~pipecut.planning.cluster.run.RunShape` fields that price a run as this
        framework runs it, with every overlap it offers."""
        return {"runtime_terms": self.runtime_terms, "distributed_optimizer": self.distributed_optimizer,
                "overlapped_reduction": Overlap.DATA_PARALLEL in self.overlaps}

    def check_overlaps(self, asked: tuple[Overlap, ...], run: str) -> None:
        """InputError naming ``run`` where it asks for an overlap this framework does not do."""
        missing = [o.value for o in asked if o not in self.overlaps]
        if missing:
            raise InputError(f"{run}: {self.kind.value} does not overlap {', '.join(missing)} communication "
                             f"(it overlaps: {[o.value for o in self.overlaps] or 'nothing'}); price the run without it")


@functools.cache
def _load() -> dict[str, Any]:
    return json.loads(resources.files("pipecut").joinpath("frameworks.json").read_text())  # type: ignore[no-any-return]


def framework(kind: FrameworkKind | str) -> Framework:
    """The framework ``kind`` (an :class:`FrameworkKind` or its value)."""
    try:
        k = FrameworkKind(kind)
    except ValueError:
        raise InputError(f"unknown framework {kind!r}; frameworks: {[e.value for e in FrameworkKind]}") from None
    raw = _load()["frameworks"][k.value]
    return Framework(kind=k, kernels=KernelsKind(raw["kernels"]), describes=raw["describes"],
                  runtime_terms=tuple(RuntimeTerm(t) for t in raw["runtime_terms"]),
                  memory_counts=tuple(raw["memory_counts"]), why_these_kernels=raw.get("why_these_kernels", ""),
                  overlaps=tuple(Overlap(o) for o in raw["overlaps"]),
                  distributed_optimizer=raw["zero1"] == "distributed-optimizer",
                  regathers=raw["sequence_parallel_inputs"] == "regathered")


def frameworks() -> tuple[Framework, ...]:
    """Every framework of ``frameworks.json``, in :class:`FrameworkKind` order."""
    return tuple(framework(k) for k in FrameworkKind)


def kernels_figure(kernels: KernelsKind, family: str, *, framework_kind: FrameworkKind | None = None) -> tuple[Figure, str]:
    """(the figure of ``kernels`` on ``family``, the run it was fitted on); an InputError that
    names the framework where no run on those kernels was fitted for the family."""
    raw = _load()["kernels"][kernels.value]
    if family not in raw:
        who = f"framework {framework_kind.value!r} runs" if framework_kind is not None else "no framework runs"
        fitted = sorted(f for f in raw if f != "describes")
        raise InputError(
            f"{who} {kernels.value} kernels, and no published run on them is fitted for the {family or 'unnamed'} "
            f"family (fitted: {fitted or 'none'}): that framework cannot be priced on this device; pass another framework "
            f"(frameworks: {[e.value for e in FrameworkKind]})"
        )
    f = raw[family]
    return Figure(value=float(f["value"]), low=float(f["low"]), high=float(f["high"]), source=f["source"]), f["fitted_on"]


def fp8_saved(rows: Sequence[NodeCost], fp8_rows: frozenset[str]) -> tuple[NodeCost, ...]:
    """``rows`` as a run with ``fp8_rows`` in FP8 keeps them: each of those products' saved input
    at :data:`FP8_SAVED_FRACTION` of its bf16 bytes (a table row's ``saved_bytes`` of a product
    is its input), every other row as it is.

    Raises:
        InputError: a name of ``fp8_rows`` is not a row.
    """
    names = {r.name for r in rows}
    missing = sorted(fp8_rows - names)
    if missing:
        raise InputError(f"fp8_rows {missing} are not rows of the cost table; name its products' rows")
    return tuple(dataclasses.replace(r, saved_bytes=math.ceil(r.saved_bytes * FP8_SAVED_FRACTION))
                 if r.name in fp8_rows and r.saved_bytes is not None else r for r in rows)
