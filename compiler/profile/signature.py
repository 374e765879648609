"""When two nodes cost the same: a key for "this op on inputs like these".

A transformer repeats one block N times, so its graph repeats the same ops on tensors of the
same shapes N times; timing each copy again costs profiling time and buys only noise (the copies
then differ by a few percent, which nudges the split for no reason). :func:`cost_key` gives two
nodes the same key when they run the same operation (the same function or method; a module of
the same type and configuration, in the same training mode, holding parameters and buffers of
the same shapes) on inputs of the same structure, shapes, strides, dtypes, devices and
``requires_grad``, with equal constant arguments, and when both write or both do not write into
their first input. The profiler measures the first node of each key and reuses its times for the
others; a node whose arguments are not plain data (an object whose repr could hide a difference)
gets no key and is always measured.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.fx as fx

from pipecut.core.torch_private import pytree

__all__ = ["cost_key"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class _NoKey(Exception):
    """An argument whose effect on the cost cannot be read off its value."""


def _leaf(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return (
            "T", tuple(x.shape), tuple(x.stride()) if x.layout is torch.strided else (), x.dtype,
            x.device, x.layout, x.requires_grad, isinstance(x, torch.nn.Parameter),
        )
    if isinstance(x, _PLAIN) or x is Ellipsis:
        return (type(x).__name__, x)
    if isinstance(x, slice):
        return ("slice", _leaf(x.start), _leaf(x.stop), _leaf(x.step))
    raise _NoKey(type(x).__name__)


def _module_key(module: torch.nn.Module) -> Hashable:
    state = [*module.named_parameters(), *module.named_buffers()]
    return (
        type(module), repr(module), tuple(m.training for m in module.modules()),
        tuple((n, _leaf(t)) for n, t in state),
    )


def cost_key(
    node: fx.Node, root: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], inplace: bool
) -> Hashable | None:
    """The key under which ``node``, run on ``args``/``kwargs``, shares its measured cost; None
    when it must be measured on its own."""
    try:
        if node.op == "call_module":
            head: Hashable = ("module", _module_key(root.get_submodule(str(node.target))))
        elif node.op == "call_function":
            hash(node.target)
            head = ("function", node.target)
        elif node.op == "call_method":
            head = ("method", str(node.target))
        else:
            return None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return (head, inplace, str(spec), tuple(_leaf(x) for x in leaves))
    except (_NoKey, TypeError):
        return None
