"""Activation memory a stage keeps between forward and backward, measured as it runs.

Autograd's saved-tensor hooks see every tensor a forward keeps for its backward. Counting each
storage once per microbatch (parameters excluded: they are not activations) and summing over
the microbatches in flight gives the stage's live activation bytes; the peak over a step is
what the schedule costs in memory. With recompute the stage keeps only its inputs, which are
counted explicitly (``torch.utils.checkpoint`` holds them outside autograd's saved tensors), as
are the inputs of each segment that recomputes (:meth:`ActivationMeter.keep`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ActivationMeter", "storage_of"]


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The memory ``t`` occupies on this rank: a DTensor's (tensor-parallel parameters, what
    autograd saves of their products) is its local shard's."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.untyped_storage()


class ActivationMeter:
    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._params = {storage_of(p).data_ptr() for p in parameters}
        self._per_mb: dict[int, dict[int, int]] = {}
        self._held: dict[int, int] = {}
        self.sending = self.peak_sending = 0
        """Bytes of sent tensors alive only because their send has not completed (now, peak)."""
        self.live = 0
        self.peak = 0
        self._current: int | None = None
        """The microbatch whose forward is running, if one is."""

    def reset(self) -> None:
        self._per_mb.clear()
        self._held.clear()
        self.live = self.peak = self.sending = self.peak_sending = 0

    def _add(self, mb: int, t: torch.Tensor) -> None:
        storage = storage_of(t)
        ptr = storage.data_ptr()
        seen = self._per_mb.setdefault(mb, {})
        if ptr in self._params or ptr in seen or ptr == 0:
            return
        seen[ptr] = storage.nbytes()
        self.live += seen[ptr]
        self.peak = max(self.peak, self.live)

    @contextlib.contextmanager
    def forward(self, mb: int, kept_inputs: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Count what this microbatch's forward keeps (and ``kept_inputs``, for recompute)."""
        for t in kept_inputs:
            self._add(mb, t)

        def pack(t: torch.Tensor) -> torch.Tensor:
            self._add(mb, t)
            # Not ``t`` itself: a node that saves its own output would then hold a tensor whose
            # grad_fn is that node, a cycle through C++ that no collector breaks. Backward
            # breaks it by freeing what was saved, but a graph kept with retain_graph=True
            # (zero-bubble's split backward) leaked every microbatch's activations.
            return t.detach()

        self._current = mb
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            self._current = None

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Inside :meth:`forward`: count tensors kept outside autograd's saved tensors (the
        inputs of a segment that recomputes, held by ``torch.utils.checkpoint``)."""
        if self._current is not None:
            for t in tensors:
                self._add(self._current, t)

    def release(self, mb: int) -> None:
        """The microbatch's backward has run: its activations are freed."""
        self.live -= sum(self._per_mb.pop(mb, {}).values())

    def hold(self, key: int, sent: Iterable[torch.Tensor]) -> None:
        """Tensors being sent are alive until their send completes: count the storages no
        microbatch's activations already count, until :meth:`drop` (``key``: the send batch)."""
        counted = {ptr for seen in self._per_mb.values() for ptr in seen}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in sent}
        size = sum(n for ptr, n in storages.items() if ptr not in counted and ptr not in self._params)
        if size:
            self._held[key] = size
            self.live += size
            self.sending += size
            self.peak = max(self.peak, self.live)
            self.peak_sending = max(self.peak_sending, self.sending)

    def drop(self, key: int) -> None:
        size = self._held.pop(key, 0)
        self.live -= size
        self.sending -= size
