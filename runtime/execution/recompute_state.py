"""Module state during a recomputed forward: the values the forward saw, writes thrown away.

A stage that recomputes (``torch.utils.checkpoint``) runs its forward again inside backward.
A forward that writes module state in place, as BatchNorm's running statistics and
``num_batches_tracked`` are in train mode, would then write it twice per microbatch: the plain
model's statistics would silently differ from the pipeline's. Checkpointing does not prevent it.

So a recomputing stage copies its buffers before each microbatch's forward and keeps the copies
of those the forward changed. While that microbatch's backward runs (and with it the
recompute), those buffers are swapped for the copies: the recompute reads what the forward read
and writes into the copies, which are then dropped. Buffers are small (statistics, masks), and
only the written ones outlive the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["StateReplay"]


class StateReplay:
    def __init__(self, module: torch.nn.Module) -> None:
        self._slots = [
            (m, name) for m in module.modules() for name, b in m._buffers.items() if b is not None
        ]
        self._saved: dict[int, dict[int, torch.Tensor]] = {}
        """Per microbatch: id of a buffer its forward wrote -> the value before that forward."""

    def reset(self) -> None:
        self._saved.clear()

    def _buffers(self) -> dict[int, torch.Tensor]:
        """This stage's buffers by identity (one registered in two modules counts once)."""
        out: dict[int, torch.Tensor] = {}
        for m, name in self._slots:
            b = m._buffers[name]
            if b is not None:
                out.setdefault(id(b), b)
        return out

    @contextlib.contextmanager
    def forward(self, mb: int) -> Iterator[None]:
        """Run microbatch ``mb``'s forward, remembering the buffers it writes as they were."""
        buffers = self._buffers()
        with torch.no_grad():
            before = {key: b.clone() for key, b in buffers.items()}
        yield
        self._saved[mb] = {key: old for key, old in before.items() if not _same(old, buffers[key])}

    @contextlib.contextmanager
    def replaying(self, mb: int, keep: bool = False) -> Iterator[None]:
        """Inside: the buffers ``mb``'s forward wrote hold their values from before it.
        ``keep``: for a later part of the same backward too (a split backward's input pass)."""
        saved = self._saved.get(mb, {}) if keep else self._saved.pop(mb, {})
        swapped = []
        for m, name in self._slots:
            b = m._buffers[name]
            if b is not None and id(b) in saved:
                swapped.append((m, name, b))
                m._buffers[name] = saved[id(b)]
        try:
            yield
        finally:
            for m, name, b in swapped:
                m._buffers[name] = b


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
