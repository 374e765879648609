"""Hugging Face models built on meta: what no checkpoint holds, computed as ``from_pretrained`` does.

``from_pretrained`` builds the model on meta, loads the checkpoint's tensors, and then runs
``initialize_weights``: every module, children before parents, gets the ``_init_weights`` of
its nearest ``PreTrainedModel`` (so a composite model's parts use their own), and the init
functions of ``transformers.initialization`` skip tensors that were loaded. What that leaves to
``_init_weights`` is what a checkpoint cannot hold: non-persistent buffers (rotary ``inv_freq``,
recomputed from the config by the rope init function; Gemma's ``embed_scale``) and persistent
tensors the model declares it initialises itself (``_keys_to_ignore_on_load_missing``, e.g.
Pegasus' ``final_logits_bias``).

:func:`initialise` does the same for one stage: on a copy of the model whose slots hold the
stage's new tensors (every other tensor stays meta, so nothing else is allocated), it runs the
same ``_init_weights`` calls, children before parents, but only on the modules that hold one of
those tensors or are ancestors of one (a parent's init may set its children's tensors, as
GPT-2's attention scales its ``c_proj``). Each call runs under a seed derived from ``seed`` and
the module's name, so that random values (a meta model compiled without weights) do not depend
on the number of stages; deterministic values (``inv_freq``) are bitwise those of
``from_pretrained``.
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from pipecut.core.meta import module_tensors

__all__: list[str] = []


def is_pretrained(model: torch.nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (without importing transformers: a model of
    that class can only exist once transformers is imported)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _patterns(model: torch.nn.Module, attribute: str) -> list[str]:
    return [str(p) for p in getattr(model, attribute, None) or ()]


def self_initialised(model: torch.nn.Module, names: list[str]) -> set[str]:
    """Those of ``names`` that ``from_pretrained`` initialises when a checkpoint lacks them
    (they match the model's ``_keys_to_ignore_on_load_missing``); none for other models."""
    if not is_pretrained(model):
        return set()
    patterns = _patterns(model, "_keys_to_ignore_on_load_missing")
    return {n for n in names if any(re.search(p, n) for p in patterns)}


def ignored_unexpected(model: torch.nn.Module) -> list[str]:
    """Patterns of checkpoint keys the model ignores on load: its own
    ``_keys_to_ignore_on_load_unexpected``, and for a Hugging Face model the keys that
    ``from_pretrained`` also ignores (rotary ``inv_freq`` and ``position_ids``, which older
    checkpoints hold as persistent buffers)."""
    patterns = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    if is_pretrained(model):
        buffers = [name for name, _ in model.named_buffers()]
        if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
            patterns.append(r"rotary_emb\.inv_freq")
        if any(b.endswith("position_ids") for b in buffers):
            patterns.append(r"(^|\.)position_ids$")
    return patterns


def _guarded() -> contextlib.AbstractContextManager[Any]:
    """transformers' guard making ``torch.nn.init`` functions behave like its own (as
    ``initialize_weights`` runs under it); nothing where this transformers has none."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:
        return contextlib.nullcontext()
    return guard_torch_init_functions()


def _calls(module: torch.nn.Module, prefix: str, owner: Any) -> Iterator[tuple[str, torch.nn.Module, Any]]:
    """(name, module, the PreTrainedModel whose ``_init_weights`` it gets), children first,
    as ``PreTrainedModel.initialize_weights`` (``smart_apply``) visits them."""
    transformers = sys.modules["transformers"]
    for name, child in module.named_children():
        child_owner = child if isinstance(child, transformers.PreTrainedModel) else owner
        yield from _calls(child, f"{prefix}.{name}" if prefix else name, child_owner)
    yield prefix, module, owner


def initialise(
    model: torch.nn.Module, new: Mapping[str, torch.Tensor], seeded: Callable[[str], Any],
) -> None:
    """Fill ``new`` (the model's name of a tensor -> its new storage) as ``from_pretrained``'s
    ``initialize_weights`` would, without touching ``model``: see the module doc.
    ``seeded(fqn)``: a context manager seeding the RNG for the module named ``fqn``."""
    memo: dict[int, Any] = {}
    for name, t in module_tensors(model):
        if name in new:
            memo[id(t)] = new[name]
        elif id(t) not in memo:
            memo[id(t)] = t.detach().to("meta")
    clone = copy.deepcopy(model, memo)
    wanted = {""} | {n.rsplit(".", 1)[0] if "." in n else "" for n in new}
    for name in list(wanted):
        parts = name.split(".")
        wanted |= {".".join(parts[:i]) for i in range(1, len(parts))}
    with torch.no_grad(), _guarded():
        for fqn, module, owner in _calls(clone, "", clone):
            if fqn in wanted:
                with seeded(fqn):
                    owner._init_weights(module)


def saved_name(keys: Sequence[str], model: torch.nn.Module | None) -> str:
    """The one of a tied weight's state-dict ``keys`` (in the model's order) that
    ``save_pretrained`` writes: for a Hugging Face model, the names matching its
    ``_tied_weights_keys`` (which ``from_pretrained`` ties again) are dropped, in sorted order
    and keeping one, as ``remove_tied_weights_from_state_dict`` does; of the rest, and for any
    other model, the first (``transformer.wte.weight``, not GPT-2's ``lm_head.weight``)."""
    if len(keys) == 1 or model is None or not is_pretrained(model):
        return keys[0]
    targets = [f"{prefix}.{k}" if prefix else str(k) for prefix, sub in model.named_modules()
               for k in getattr(sub, "_tied_weights_keys", None) or ()]
    dropped: set[str] = set()
    for key in sorted(keys):
        if len(dropped) < len(keys) - 1 and any(re.search(p, key) for p in targets):
            dropped.add(key)
    return next(k for k in keys if k not in dropped)
