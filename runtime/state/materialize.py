"""Give one stage real tensors: allocate its meta tensors on the device, fill them from weights or
initialise them, and leave every other stage's tensors on meta.

A stage's tensors are those its GraphModule holds (split copies only what the stage reads).
Each is known by all the names it has in the model (a tied weight has several); a weight
source is searched under any of them, so a Hugging Face GPT-2 directory, which stores only
``transformer.wte.weight``, fills ``lm_head.weight`` too.

Without weights, a tensor is initialised by the module that owns it under its *canonical*
(first) name, with ``init(fqn, module)`` if given, else ``module.reset_parameters()`` (for a
Hugging Face model: its own ``_init_weights``, as ``from_pretrained`` runs it, which also
computes what no checkpoint holds, such as rotary ``inv_freq``; see :mod:`.pretrained`), under a
seed derived from ``seed`` and the module's name: every rank gets the values the whole model
would get, whatever the number of stages (:func:`materialize_model` is that whole model). The
owner runs on a copy of itself (cheap: its tensors are meta) whose slots hold this stage's new
tensors, so the user's model is never modified and other stages' tensors stay meta. Floating
tensors start as NaN; one the initialiser left untouched is an error, never uninitialised memory.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipecut.core.meta import empty_like, is_meta, module_tensors, rebind
from pipecut.errors import InputError, PipelineRuntimeError
from pipecut.runtime.state import pretrained
from pipecut.runtime.state.weights import WeightSource

__all__: list[str] = []

Init = Callable[[str, torch.nn.Module], Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Materialized:
    """What :func:`materialize_stage` did, for tests and the memory benchmark."""

    allocated_bytes: int
    """Bytes of new tensors this stage allocated on its device."""
    loaded: tuple[str, ...]
    """Canonical names filled from the weights."""
    initialised: tuple[str, ...]
    """Canonical names filled by their module's initialiser."""


def module_seed(seed: int, fqn: str) -> int:
    """A stable seed per module name (Python's hash() differs between processes)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{fqn}".encode()).digest()[:8], "little") >> 1


def _aliases(root: torch.nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, t in module_tensors(root):
        if name not in names.setdefault(id(t), []):
            names[id(t)].append(name)
    return names


def _non_persistent(model: torch.nn.Module) -> set[str]:
    out = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        out |= {f"{prefix}.{b}" if prefix else b for b in module._non_persistent_buffers_set}
    return out


def check_unexpected(source: WeightSource, model: torch.nn.Module) -> None:
    """Refuse weights holding tensors the model has no name for (another model's checkpoint)."""
    known = {name for name, _ in module_tensors(model)}
    ignore = pretrained.ignored_unexpected(model)
    unexpected = sorted(k for k in source.keys - known if not any(re.search(p, k) for p in ignore))
    if unexpected:
        raise InputError(
            f"weights {source.description} hold {len(unexpected)} tensor(s) the model has no "
            f"parameter or buffer for, e.g. {unexpected[:5]} (in {source.where(unexpected[0])}); "
            f"they were saved from another model or config: load the matching weights"
        )


def _load(
    todo: dict[int, tuple[torch.Tensor, torch.Tensor, list[str]]], source: WeightSource,
    device: torch.device, where: str,
) -> list[str]:
    """Copy tensors found in ``source`` into their new storage; returns canonical names loaded."""
    keys = {i: next((n for n in names if n in source.keys), None) for i, (_, _, names) in todo.items()}
    found = {i: k for i, k in keys.items() if k is not None}
    by_key: dict[str, list[int]] = {}
    for i, k in found.items():
        by_key.setdefault(k, []).append(i)
    for key, value in source.read(list(by_key), device):  # one tensor at a time
        for i in by_key[key]:
            _copy_in(todo[i], key, value, source, where)
    return [todo[i][2][0] for i in found]


def _copy_in(
    entry: tuple[torch.Tensor, torch.Tensor, list[str]], key: str, value: torch.Tensor,
    source: WeightSource, where: str,
) -> None:
    old, new, names = entry
    if tuple(value.shape) != tuple(old.shape):
        raise InputError(
            f"{where}: tensor {key!r} in {source.where(key)} has shape {tuple(value.shape)}, "
            f"the model's {names[0]!r} has {tuple(old.shape)}; load weights saved from "
            f"this model's config"
        )
    if value.dtype != old.dtype:
        raise InputError(
            f"{where}: tensor {key!r} in {source.where(key)} is {value.dtype}, the model's "
            f"{names[0]!r} is {old.dtype}; build the model in {value.dtype} (e.g. "
            f"torch_dtype=/.to() before compile) or convert the weights"
        )
    with torch.no_grad():
        new.copy_(value)


@contextlib.contextmanager
def _seeded(seed: int, fqn: str, device: torch.device) -> Iterator[None]:
    """The RNG seeded for the module named ``fqn``, as it was again on exit."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(module_seed(seed, fqn))
        yield


def _run_initialisers(
    owners: list[str], model: torch.nn.Module, new_by_name: dict[str, torch.Tensor],
    init: Init | None, seed: int, device: torch.device,
) -> None:
    """``init(fqn, clone)`` or ``clone.reset_parameters()`` per owner, in a fixed order, each
    under its own seed, on a copy of the owner whose slots hold the new tensors."""
    for fqn in owners:
        owner = model.get_submodule(fqn)
        dot = f"{fqn}." if fqn else ""
        memo: dict[int, Any] = {}
        for name, t in module_tensors(owner):
            memo[id(t)] = new_by_name.get(dot + name, t.detach().to("meta"))
        clone = copy.deepcopy(owner, memo)
        with _seeded(seed, fqn, device), torch.no_grad():
            if init is not None:
                init(fqn, clone)
            else:
                clone.reset_parameters()  # type: ignore[operator]


def _initialise(
    todo: dict[int, tuple[torch.Tensor, torch.Tensor, list[str]]], model: torch.nn.Module,
    init: Init | None, seed: int, device: torch.device, where: str, non_persistent: set[str],
    loaded_some: bool = False,
) -> list[str]:
    """Run each owner's initialiser on a copy of it whose slots hold the new tensors (for a
    Hugging Face model without ``init``: its ``_init_weights``, see :mod:`.pretrained`)."""
    by_owner: dict[str, list[int]] = {}
    for i, (_, _, names) in todo.items():
        by_owner.setdefault(names[0].rpartition(".")[0], []).append(i)
    new_by_name = {n: new for _, new, names in todo.values() for n in names}
    hugging_face = init is None and pretrained.is_pretrained(model)
    missing_init = [
        f"{fqn or '<root>'} ({type(model.get_submodule(fqn)).__name__})" for fqn in by_owner
        if init is None and not hugging_face and not hasattr(model.get_submodule(fqn), "reset_parameters")
    ]
    if missing_init:
        buffers = sorted(names[0] for _, _, names in todo.values() if names[0] in non_persistent)
        hint = (
            f" (non-persistent buffers {buffers[:5]} are in no checkpoint: init= must compute "
            f"them, or build their module on a real device)" if buffers else ""
        )
        raise InputError(
            f"{where}: {'the weights lack tensors of' if loaded_some else 'weights=None and'} "
            f"these modules, which have no reset_parameters() to initialise them: "
            f"{missing_init[:10]}; pass weights= (a safetensors file or save_pretrained "
            f"directory) or init=callable(fqn, module){hint}"
        )
    with torch.no_grad():
        for _, new, _ in todo.values():
            if new.is_floating_point():
                new.fill_(float("nan"))
            else:
                new.zero_()
    if hugging_face:
        pretrained.initialise(model, new_by_name, lambda fqn: _seeded(seed, fqn, device))
    else:
        _run_initialisers(sorted(by_owner), model, new_by_name, init, seed, device)
    untouched = [names[0] for _, new, names in todo.values() if new.is_floating_point() and new.isnan().any()]
    if untouched:
        buffers = [n for n in untouched if n in non_persistent]
        hint = (
            f" ({buffers[:5]} are non-persistent buffers: no checkpoint holds them, so init= must "
            f"compute them or the module must be built on a real device)" if buffers else ""
        )
        raise InputError(
            f"{where}: the initialiser left {untouched[:10]} unset (NaN){hint}; pass weights= "
            f"holding them or an init=callable(fqn, module) that sets every tensor of the module"
        )
    return [todo[i][2][0] for i in todo]


def materialize_stage(
    stage: torch.nn.Module, roots: tuple[torch.nn.Module, ...], model: torch.nn.Module, *,
    device: torch.device, source: WeightSource | None, init: Init | None, seed: int, where: str,
) -> Materialized:
    """Make ``stage``'s tensors real on ``device`` and fill them; rebind them in ``roots`` too.

    ``roots``: modules sharing the stage's tensor objects (the captured graph), kept consistent
    so that names resolve to the new tensors. Real tensors are filled in place from ``source``;
    meta tensors get new storage. Meta tensors absent from ``source`` (or all of them, without
    one) are initialised; a non-persistent buffer absent from ``source`` needs ``init``.
    """
    mine = {id(t): t for _, t in module_tensors(stage)}
    if source is None and not any(is_meta(t) for t in mine.values()):
        return Materialized(allocated_bytes=0, loaded=(), initialised=())
    aliases = _aliases(roots[0] if roots else stage)
    order = {name: i for i, (name, _) in enumerate(module_tensors(model))}
    for names in aliases.values():  # canonical = first in the model's order, as for the reference
        names.sort(key=lambda n: order.get(n, len(order)))
    todo: dict[int, tuple[torch.Tensor, torch.Tensor, list[str]]] = {}
    for i, t in mine.items():
        new = empty_like(t, device) if is_meta(t) else t
        todo[i] = (t, new, aliases.get(i, [name for name, x in module_tensors(stage) if x is t]))
    loaded: list[str] = []
    if source is not None:
        loaded = _load(todo, source, device, where)
    loaded_set = set(loaded)
    rest = {i: v for i, v in todo.items() if is_meta(v[0]) and v[2][0] not in loaded_set}
    non_persistent = _non_persistent(model)
    if source is not None:  # what no checkpoint holds is initialised; anything else must be there
        unloaded = [v[2][0] for v in todo.values() if v[2][0] not in loaded_set]
        absent = sorted(set(unloaded) - non_persistent - pretrained.self_initialised(model, unloaded))
        if absent:
            raise InputError(
                f"{where}: weights {source.description} lack {len(absent)} tensor(s) this stage "
                f"needs, e.g. {absent[:5]} (looked up under every alias); load the weights saved "
                f"from this model"
            )
    initialised = (
        _initialise(rest, model, init, seed, device, where, non_persistent, source is not None)
        if rest else []
    )
    mapping = {i: new for i, (old, new, _) in todo.items() if new is not old}
    for root in (stage, *roots):
        rebind(root, mapping)
    return Materialized(
        allocated_bytes=sum(t.numel() * t.element_size() for t in mapping.values()),
        loaded=tuple(loaded), initialised=tuple(initialised),
    )


def raise_together(failure: BaseException | None, what: str = "build its stage") -> None:
    """Collective: every rank learns whether any rank failed to ``what`` (build its stage), so
    that the others fail at once naming it instead of waiting in the next collective until
    timeout. Also a barrier of every rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, None if failure is None else f"{type(failure).__name__}: {failure}")
    except Exception as e:  # a rank never came: stuck in a collective of its own, or dead
        if failure is not None:
            raise failure from e
        raise PipelineRuntimeError(
            f"rank {dist.get_rank()} could {what}, but not every rank reported whether it could (the group's "
            f"timeout passed: a rank is stuck or died; its own error is on that rank): {e}"
        ) from e
    if failure is not None:
        raise failure
    bad = [(r, message) for r, message in enumerate(everyone) if message is not None]
    if bad:
        rank, message = bad[0]
        raise PipelineRuntimeError(
            f"rank {dist.get_rank()} stopped because rank {rank} failed to {what}: {message}"
        )


def materialize_model(
    model: torch.nn.Module, device: torch.device | str = "cpu", *, init: Init | None = None,
    seed: int = 0,
) -> torch.nn.Module:
    """A real copy of a meta ``model`` initialised exactly as ``pipecut.compile`` initialises
    each stage (weights=None): the one-process reference of a pipeline built without weights."""
    clone = copy.deepcopy(model)
    materialize_stage(clone, (), model, device=torch.device(device), source=None, init=init,
                      seed=seed, where="model")
    return clone
