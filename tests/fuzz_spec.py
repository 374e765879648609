"""What the differential fuzzer needs to know about one model: :class:`ModelSpec`.

The fuzzer's hand-written models (tests/fuzz_models.py) and its transformers architectures
(tests/fuzz_real.py, from examples/architectures.py) are both described this way, so a
configuration can name either and everything downstream (plans, the ranks' loop, the
reference) treats them alike: a model built from a seed, a batch drawn at any row count, a mean
and a summed loss, and the module and parameter names a configuration may pin or freeze.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """One model of the fuzzer's zoo."""

    name: str
    model: Callable[[int], nn.Module]
    """Builds the model from a seed (the same seed, the same weights)."""
    data: Callable[[int, int, int], tuple[Any, torch.Tensor]]
    """(rows, seed, seq) -> (inputs, target); ``seq`` matters only where :attr:`seq` is set."""
    loss: Callable[..., torch.Tensor]
    loss_sum: Callable[..., torch.Tensor]
    """The same loss summed over the target's valid entries (target -100 is padding)."""
    split_points: tuple[str, ...]
    """Modules where a stage may begin, in order (a pinned split draws from them)."""
    blocks: str
    """The module list whose blocks a selective recompute plan recomputes."""
    freezable: tuple[str, ...]
    """Trainable parameters a configuration may freeze for one optimizer step after compile (by
    the names of ``named_parameters()``: a tied weight by its first name)."""
    seq: int | None = None
    """The sequence length, for models where a shorter sequence is a valid last batch."""
    batchnorm: bool = False
    """Running statistics: the reference runs microbatch by microbatch, and no data parallelism."""
    head: str | None = None
    """A linear head, named as the captured graph's node, that a ``heavy`` plan computes in row
    pieces (symbolic_trace graphs only: torch.export names nodes by op)."""
    real: bool = False
    """A transformers architecture (captured by torch.export; slower to compile)."""

    def build(self, seed: int, attention: str = "default") -> nn.Module:
        """The model for ``seed``; a transformers one with ``attention`` (``"default"``: as a
        user builds it)."""
        if self.real:
            return self.model(seed, None if attention == "default" else attention)
        return self.model(seed)


def seeded(cls: Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    """``cls()`` built right after ``torch.manual_seed(seed)``."""

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return cls()

    return build
