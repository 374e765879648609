"""The user's names for the tensors of a captured graph.

A captured graph does not always name a tensor as the user's model does: torch.export keeps one
name per tied weight, and not always the model's first (GPT-2's ``lm_head.weight`` for
``transformer.wte.weight``, T5's ``encoder.embed_tokens.weight`` for ``shared.weight``), and it
adds tensors the model does not have (lifted constants such as ``lifted_tensor_0``). The
pipeline's ``named_parameters``, ``named_buffers`` and ``state_dict`` speak the model's names, so
that name-based optimizer groups work and the ranks' state dicts, merged, load into the plain
model with ``strict=True``. Names are matched by tensor identity: the captured graph holds the
model's own parameter and buffer objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__: list[str] = []


@dataclass(frozen=True)
class ModelNames:
    """From a tensor's name in the captured graph (any alias) to the user's model's names."""

    first: Mapping[str, str]
    """The model's first name of the tensor, as ``model.named_parameters()`` / ``named_buffers()``
    give it. Graph tensors the model does not have are absent."""
    state: Mapping[str, tuple[str, ...]]
    """Every key ``model.state_dict()`` has for the tensor (a tied weight has several; a
    non-persistent buffer none)."""

    def public(self, name: str) -> str | None:
        """The model's name for a graph tensor name; None if the model has no such tensor."""
        return self.first.get(name)


def model_names(gm: torch.nn.Module, model: torch.nn.Module) -> ModelNames:
    firsts: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        firsts.setdefault(id(t), name)
    keys: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        keys.setdefault(id(t), []).append(key)
    by_name = {n: id(t) for n, t in [*model.named_parameters(remove_duplicate=False),
                                     *model.named_buffers(remove_duplicate=False)]}
    first: dict[str, str] = {}
    state: dict[str, tuple[str, ...]] = {}
    for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        ident = id(t) if id(t) in firsts else by_name.get(name)  # a copy under the model's own name
        if ident is None:
            continue  # not the model's (a constant lifted by torch.export)
        first[name] = firsts[ident]
        state[name] = tuple(keys.get(ident, ()))
    return ModelNames(first=first, state=state)
