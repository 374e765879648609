"""Tied weights' gradients: summed over the stages that hold them, each contribution once.

A parameter used by several stages (tied input/output embeddings, a head computed in pieces)
lives on each of them, and each stage's backward adds only its own uses to its copy's
``.grad``. After a step the copies are summed over the ranks holding them, so every copy holds
the whole gradient, as the plain model's one parameter does.

Gradient accumulation (several ``pipe.step`` calls before ``opt.step()``) makes the sum
subtle: after the first step every copy already holds the summed gradient, and summing the
whole ``.grad`` again after the second step would count the first step once per stage. So the
summed gradient a step leaves behind is set aside before the next step, only the new step's
contributions are summed, and the set-aside part is added back afterwards. A step that does not
reduce (``pipe.no_sync()``) leaves its contributions local; the next reducing step sums all of
them at once, as DDP's ``no_sync`` does for data parallelism.

Setting aside copies the gradient (one more gradient-sized tensor per tied weight, only when
accumulating without ``no_sync``). Only a gradient this object left summed is set aside, recognised by identity: after
``opt.zero_grad()`` (``.grad`` None) there is nothing to set aside, and a gradient zeroed or
clipped in place is still the summed one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["TiedGrads"]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: an FSDP gradient is a DTensor whose local shard is reduced."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


class TiedGrads:
    """The tied parameters of one rank's stages and the process group of each.

    ``groups``: (canonical name, group of the ranks holding it); ``None`` as group means the
    default group.
    """

    def __init__(self, groups: Sequence[tuple[str, dist.ProcessGroup | None]]) -> None:
        self.groups = tuple(groups)
        self._summed: dict[str, torch.Tensor] = {}
        """Per name, the ``.grad`` tensor the last reducing step left holding the summed gradient."""
        self._aside: dict[str, torch.Tensor] = {}
        """Per name, a summed gradient set aside while steps add their own contributions."""
        self._left: dict[str, torch.Tensor | None] = {}
        """Per name, the ``.grad`` a step under ``no_sync`` left (to notice a reset since)."""
        self.pending = False
        """Whether steps under ``no_sync`` have added contributions that are not summed yet."""

    def _params(self, named: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.nn.Parameter]:
        wanted = {fqn for fqn, _ in self.groups}
        return {fqn: p for fqn, p in named if fqn in wanted and p.requires_grad}

    def begin(self, named: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Before a training step: set aside every tied gradient that is already summed."""
        for fqn, p in self._params(named).items():
            if fqn in self._summed and p.grad is self._summed[fqn]:
                # A copy: DDP's gradient is a view of its bucket, which the next reduction
                # overwrites in place.
                self._aside[fqn] = p.grad.detach().clone()
                p.grad = None
            elif fqn in self._left and p.grad is not self._left[fqn]:
                self._aside.pop(fqn, None)  # gradients reset since a no_sync step: start afresh
        self._summed = {}

    def end(self, named: Iterable[tuple[str, torch.nn.Parameter]], reduce: bool) -> None:
        """After a training step: sum this step's (and earlier unsummed steps') contributions
        over the ranks holding each tied weight, then add back what was set aside. Without
        ``reduce`` the contributions stay local, and ``.grad`` holds only them, until a later
        reducing step completes it."""
        params = self._params(named)
        if not reduce:
            self._left = {fqn: p.grad for fqn, p in params.items()}
            self.pending = True
            return
        for fqn, group in self.groups:
            p = params.get(fqn)
            if p is None:  # not on this rank's stages, or frozen (.grad stays None, as in PyTorch)
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:  # type: ignore[attr-defined]
                # a tensor-parallel weight's gradient as DTensor's backward left it (a tied
                # head's may be replicated): each holder sums the shard it holds
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
            dist.all_reduce(_local(p.grad), group=group)
            aside = self._aside.pop(fqn, None)
            if aside is not None:
                _local(p.grad).add_(_local(aside))
            self._summed[fqn] = p.grad
        self._aside, self._left = {}, {}
        self.pending = False
