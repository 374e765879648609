"""Which node's account each tensor that autograd keeps for backward goes to.

Profiling runs the graph node by node with autograd on. Every tensor a node saves for its
backward passes a saved-tensor hook. A saved tensor that shares storage with one of the node's
inputs is charged to the node that made that storage (a Linear keeps its input: its producer's
output stays alive until backward). Any other is the node's own: what it computed and keeps (a
softmax's output, a dropout mask). A model input is charged to the node that keeps it (inputs
are no stage's units; the stage that keeps one holds it per microbatch). Each storage is
counted once, for one owner; parameters, buffers and tensor constants are not activations. This is what the planner should count per microbatch in flight,
rather than every node's whole output: a node whose output nobody saves costs nothing.

What a kernel keeps depends on the device it runs on. Estimation for a GPU counts on the CPU
(fake tensors), so where the two differ, :class:`GpuDropout` runs the op as the GPU would.

    >>> saved = SavedBytes(model_state)
    >>> value = saved.run("linear_1", (args, kwargs), lambda: runner.call(node, args, kwargs))
    >>> saved.bytes_of("linear_1")
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipecut.core.torch_private import FakeTensor, pytree

__all__ = ["GpuDropout", "SavedBytes", "storage_key"]


def storage_key(t: torch.Tensor) -> int | None:
    """What identifies ``t``'s storage (views share it): its address for a real tensor, the
    storage object's own address for a fake tensor (whose storage has no data); None for a meta
    tensor or an empty storage."""
    if isinstance(t, FakeTensor):
        storage = t.untyped_storage()
        return storage._cdata if storage.nbytes() else None
    if t.device.type == "meta":
        return None
    return t.untyped_storage().data_ptr() or None


def _storages(tree: Any) -> dict[int, int]:
    """Storage key -> bytes of every tensor in ``tree`` (meta tensors have none)."""
    out = {}
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and (key := storage_key(t)) is not None:
            out[key] = t.untyped_storage().nbytes()
    return out


class SavedBytes:
    def __init__(self, state: Iterable[torch.Tensor]) -> None:
        self._state = set(_storages(list(state)))
        self._owner: dict[int, str | None] = {}
        """Storage address -> the node whose output first held it (views keep their source's)."""
        self._charged: dict[str, dict[int, int]] = {}
        """Node -> the storages charged to it (address -> bytes)."""

    def run(self, name: str, inputs: Any, call: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> Any:
        """``call()`` (node ``name`` on ``inputs``), charging what it saves for backward;
        ``exclude``: tensors that are weights too (scratch copies of a model's parameters)."""
        held = _storages(inputs)
        skip = self._state | set(_storages(list(exclude)))
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.update(_storages(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = call()
        for ptr, size in seen.items():
            if ptr in skip:
                continue
            owner = (self._owner.get(ptr) or name) if ptr in held else name
            self._charged.setdefault(owner, {})[ptr] = size
        self.produced(name, value, held)
        return value

    def produced(self, name: str | None, value: Any, held: Iterable[int] = ()) -> None:
        """Node ``name`` made ``value``: its new storages are its own; views of ``held`` are not.
        None for a model input: it is charged to the node that keeps it (an input is no unit of
        any stage; the stage that keeps it holds it per microbatch)."""
        inputs = set(held)
        for ptr in _storages(value):
            if ptr not in inputs:  # a new storage (an address freed earlier may come back)
                self._owner[ptr] = name

    def constant(self, value: Any) -> None:
        """``value`` is model state read through an attribute (a tensor constant): not an
        activation, whoever keeps it."""
        self._state |= set(_storages(value))

    def bytes_of(self, name: str) -> int:
        return sum(self._charged.get(name, {}).values())


def _functional(input: torch.Tensor, p: float = 0.5, training: bool = True,
                inplace: bool = False) -> tuple[torch.Tensor, float, bool]:
    return input, p, training and not inplace


def _aten(input: torch.Tensor, p: float, train: bool) -> tuple[torch.Tensor, float, bool]:
    return input, p, train


_DROPOUTS: tuple[tuple[Any, Callable[..., tuple[torch.Tensor, float, bool]]], ...] = (
    (F.dropout, _functional), (torch.dropout, _aten), (torch.ops.aten.dropout.default, _aten),
)
"""Each dropout a graph may call (``nn.Dropout`` calls ``F.dropout``; a ``torch.export`` graph
holds ``aten.dropout``) and its arguments as (input, p, training and out of place)."""


class GpuDropout(TorchFunctionMode):
    """Inside, dropout runs as on a GPU wherever its tensors are: as ``aten.native_dropout``,
    which keeps a one-byte mask for backward, where the CPU's kernel multiplies by a noise
    tensor of the input's dtype and keeps that (``bernoulli_``, ``div_``, ``mul``: 2 bytes an
    element in bf16, 4 in fp32).

    ``torch.dropout`` takes the fused ``native_dropout`` on CUDA devices (ROCm's too) in
    training for 0 < p < 1 and a non-empty input, and the composite kernel elsewhere: the same
    test here. In-place dropout and the feature and alpha variants take the composite kernel on
    a GPU too, and are left as they are. The output has the same shape and dtype either way.

        >>> with GpuDropout():
        ...     y = F.dropout(x, 0.1)  # keeps a bool mask of x's shape
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        arguments = next((parse for op, parse in _DROPOUTS if op is func), None)  # by identity: not every func hashes
        if arguments is not None:
            x, p, train = arguments(*args, **kwargs)
            if train and 0 < p < 1 and x.numel() > 0:
                return torch.ops.aten.native_dropout.default(x, p, True)[0]
        return func(*args, **kwargs)
