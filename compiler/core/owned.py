"""A stage module's own submodule objects, sharing the model's tensors.

A stage module made by ``fx.GraphModule(root, graph)`` owns the containers on the path to each
module it calls, but the called modules themselves (symbolic_trace's ``nn.Linear``) are the
model's own objects. Whatever replaces a parameter slot of such a module (DTensor parameters
under tensor parallelism, FSDP2's ``fully_shard``) would then replace it in the user's model
too, and in every other pipeline compiled from it. :func:`own_path` and :func:`own_modules`
give the stage a shallow copy of each module on a path, with its own ``_parameters``,
``_buffers`` and ``_modules`` slots: the tensors stay shared (the stage still trains the
model's tensors until something swaps a slot), the slots are the stage's.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["own_modules", "own_path"]


def own_path(module: torch.nn.Module, path: str, owned: set[int] | None = None) -> torch.nn.Module:
    """The submodule of ``module`` at ``path``, with it and every module above it (``module``
    itself excepted) replaced by a shallow copy with its own slots. ``owned``: ids of copies
    made already (by earlier calls), which are not copied again."""
    owned = set() if owned is None else owned
    current = module
    for name in path.split(".") if path else ():
        child = current._modules[name]
        assert child is not None, f"{path}: no module at {name}"
        if id(child) not in owned:
            child = copy.copy(child)
            child._parameters = dict(child._parameters)
            child._buffers = dict(child._buffers)
            child._modules = dict(child._modules)
            owned.add(id(child))
            current._modules[name] = child
        current = child
    return current


def own_modules(module: torch.nn.Module) -> set[int]:
    """Give ``module`` its own copy of every submodule that holds a parameter or buffer (and of
    the modules above them); the ids of the copies. The tensors are not copied."""
    owned: set[int] = set()
    holders = [name for name, m in module.named_modules(remove_duplicate=False)
               if name and (m._parameters or m._buffers)]
    for name in holders:
        own_path(module, name, owned)
    return owned
