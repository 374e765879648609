"""Models on the meta device: capture them, measure them one node at a time, rebind their tensors.

A model built under ``with torch.device("meta"):`` has shapes and dtypes but no storage, so a
model larger than any one device can still be captured and planned. Three facts make that work:

- ``torch.export`` traces a meta model when its example inputs are on meta too; the graph then
  carries ``device=meta`` constants (``arange(..., device=meta)``), which :func:`relocate_meta`
  rewrites to the inputs' real device, so the graph (and its fingerprint) is the one a real
  model gives.
- Tensors cannot be materialised in place (``.data =`` refuses to cross from meta, and
  ``torch.utils.swap_tensors`` refuses tensors that export has weakly referenced), so a real
  tensor replaces a meta one by *rebinding*: every module slot holding the meta tensor gets the
  real one (:func:`rebind`). Tied weights stay tied: every alias slot is rebound together.
- Profiling needs real values, but only for the node being measured: :func:`scratch` rebinds
  the few meta tensors a node reads to scratch values for the time of the measurement and then
  puts the meta tensors back, so the planning device never holds more than one node's weights.
  The same holds for a real model measured on another device (a model left on the CPU, planned
  for a GPU run): the node's tensors are copied there while it is measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.fx as fx

from pipecut.core.torch_private import pytree

__all__: list[str] = []

META = torch.device("meta")


def is_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def module_tensors(root: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every parameter, buffer and plain tensor attribute, aliases included."""
    for prefix, module in root.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, value in [*module._parameters.items(), *module._buffers.items()]:
            if value is not None:
                yield dot + name, value
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):  # export's lifted constants (_tensor_constant0)
                yield dot + name, value


def has_meta(root: torch.nn.Module) -> bool:
    """True if any parameter, buffer or tensor constant of ``root`` is on the meta device."""
    return any(is_meta(t) for _, t in module_tensors(root))


def to_meta(inputs: Any) -> Any:
    """``inputs`` with every tensor replaced by a meta tensor of its shape, dtype and
    ``requires_grad``: no storage and no autograd history (which would keep the real values
    it came from alive)."""

    def meta(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        out = x.detach().to(META)
        return out.requires_grad_(True) if x.requires_grad else out

    return pytree.tree_map(meta, inputs)


def input_device(inputs: Any) -> torch.device:
    """Device of the first real tensor in ``inputs`` (CPU when there is none)."""
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and not is_meta(leaf):
            return leaf.device
    return torch.device("cpu")


def relocate_meta(gm: fx.GraphModule, device: torch.device) -> None:
    """Rewrite ``device=meta`` constants in a freshly captured graph to ``device``.

    Mutates ``gm``: call it only on a graph capture has just made and nobody else holds.
    """

    def swap(x: Any) -> Any:
        if isinstance(x, torch.device) and x.type == "meta":
            return device
        return x

    for node in gm.graph.nodes:
        node.args = pytree.tree_map(swap, node.args)
        node.kwargs = pytree.tree_map(swap, node.kwargs)
    gm.recompile()


def rebind(root: torch.nn.Module, mapping: Mapping[int, torch.Tensor]) -> None:
    """Replace, in every module slot of ``root``, each tensor whose id is in ``mapping``."""
    for module in root.modules():
        groups = cast(tuple[dict[str, Any], ...], (module._parameters, module._buffers))
        for slots in groups:
            for name, value in list(slots.items()):
                if value is not None and id(value) in mapping:
                    slots[name] = mapping[id(value)]
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and id(value) in mapping:
                setattr(module, name, mapping[id(value)])


def real_like(t: torch.Tensor, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A real tensor of ``t``'s shape and dtype on ``device``; a Parameter if ``t`` is one.

    Floating values are small normal noise (like a typical initialisation, so no overflow
    downstream); integer and boolean ones are zero.
    """
    if t.is_floating_point():
        value = torch.randn(t.shape, dtype=torch.float32, generator=generator).mul_(0.02).to(t.dtype)
        value = value.to(device)
    else:
        value = torch.zeros(t.shape, dtype=t.dtype, device=device)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(value, requires_grad=t.requires_grad)
    return value


def empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialised storage of ``t``'s shape and dtype on ``device``; a Parameter if ``t`` is one."""
    value = torch.empty(t.shape, dtype=t.dtype, device=device)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(value, requires_grad=t.requires_grad)
    return value


def copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached copy of ``t`` on ``device``; a Parameter (same ``requires_grad``) if ``t`` is one."""
    value = t.detach().to(device, copy=True)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(value, requires_grad=t.requires_grad)
    return value


def elsewhere(t: Any, device: torch.device) -> bool:
    """True for a tensor that cannot be used on ``device`` as it is: meta, or on another device."""
    return isinstance(t, torch.Tensor) and (is_meta(t) or t.device != device)


@contextlib.contextmanager
def scratch(
    root: torch.nn.Module, tensors: Iterable[torch.Tensor], device: torch.device
) -> Iterator[dict[int, torch.Tensor]]:
    """Rebind those of ``tensors`` not on ``device`` in ``root`` to stand-ins there while inside.

    A meta tensor's stand-in is scratch noise (:func:`real_like`); a real tensor on another
    device gets a copy of its values. Yields id(tensor) -> its stand-in, so that values already
    fetched (``get_attr`` results) can be swapped too. On exit the originals are put back and
    the stand-ins freed.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tensors = [t for t in tensors if elsewhere(t, device)]
    if not tensors:  # already where it is measured: nothing to do (and no walk over its modules)
        yield {}
        return
    generator = torch.Generator().manual_seed(0)
    real = {id(t): real_like(t, device, generator) if is_meta(t) else copy_to(t, device) for t in tensors}
    back = {id(real[id(t)]): t for t in tensors if id(t) in real}
    rebind(root, real)
    try:
        yield real
    finally:
        rebind(root, back)


def read_by(node: fx.Node, root: torch.nn.Module, values: Any) -> list[torch.Tensor]:
    """The tensors a node reads: in its argument ``values`` and, for a module call, the module's
    own parameters and buffers."""
    found = {id(t): t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)}
    if node.op == "call_module":
        for _, t in module_tensors(root.get_submodule(str(node.target))):
            found[id(t)] = t
    return list(found.values())


def substitute(values: Any, real: Mapping[int, torch.Tensor]) -> Any:
    return pytree.tree_map(lambda x: real.get(id(x), x) if isinstance(x, torch.Tensor) else x, values)
