"""Gradient post-processing across stages: the loss weighting, clipping, and loss scaling.

Three things an ordinary training loop does on one process become collective once the model
is split, and each is easy to get silently wrong:

- **Loss weighting.** ``loss_reduction="mean"`` (the default) divides each microbatch's loss by
  M, which equals the full batch's loss only when every microbatch weighs the same. A loss
  averaged over valid tokens (``ignore_index`` padding) does not: ``"sum"`` has ``loss_fn``
  return each microbatch's sum and divides it by a normaliser counted over the whole batch.
- **Clipping.** The total norm must cover every stage, count a tied weight (held, with the same
  summed gradient, by several stages) once, and give every rank the same clipping coefficient.
  Each parameter is counted on the first stage that holds it; the per-parameter norms are
  exchanged in one all-reduce over the pipeline group, so every rank sees all of them in the
  plan's order and computes bitwise the same total. Data-parallel replicas hold equal
  gradients after averaging, so the pipeline group suffices; under FSDP each parameter's norm
  is first reduced over its replicas' shards.
- **Loss scaling.** ``torch.amp.GradScaler`` looks for inf/NaN in this rank's gradients only,
  so stages would disagree on skipping a step. ``ShardedGradScaler`` all-reduces its finding
  over a process group; over the pipeline group every rank skips the same steps and updates
  the scale identically. A plain enabled ``GradScaler`` on more than one rank is refused.
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from pipecut.core.torch_private import foreach_norm
from pipecut.errors import InputError, PipelineRuntimeError
from pipecut.ir import Plan
from pipecut.options import LossReduction
from pipecut.runtime.comm.sync import wait_for

__all__ = [
    "clip_grad_norm_",
    "loss_divisor",
    "parse_loss_reduction",
    "replica_share",
    "scale_loss_fn",
    "sharded_grad_scaler",
    "share_loss",
    "total_grad_norm",
]


def parse_loss_reduction(value: str | LossReduction) -> LossReduction:
    if isinstance(value, LossReduction):
        return value
    try:
        return LossReduction(value)
    except ValueError:
        valid = ", ".join(repr(r.value) for r in LossReduction)
        raise InputError(f"unknown loss_reduction {value!r}; valid: {valid}") from None


def loss_divisor(
    reduction: LossReduction, microbatches: int, normalizer: Any, replicas: int = 1
) -> int | float:
    """What each microbatch's loss is divided by.

    With D data-parallel replicas, gradients are averaged over replicas afterwards; the
    normaliser counts the whole batch of all replicas, so each replica divides by n / D and
    the average is the sum over all replicas divided by n.
    """
    if reduction is LossReduction.MEAN:
        if normalizer is not None:
            raise InputError(
                f"step got normalizer={normalizer!r} but the pipeline was compiled with "
                f"loss_reduction='mean' (each microbatch's loss / {microbatches}); compile with "
                f"loss_reduction='sum' and a loss_fn that returns a sum, or drop normalizer"
            )
        return microbatches
    if normalizer is None:
        return 1 / replicas if replicas > 1 else 1
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise InputError(f"normalizer must be a number or a one-element tensor, got shape {tuple(normalizer.shape)}")
        normalizer = normalizer.item()
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
        raise InputError(f"normalizer must be a number or a one-element tensor, got {type(normalizer).__name__}")
    if not math.isfinite(normalizer) or normalizer <= 0:
        raise InputError(
            f"normalizer must be finite and > 0, got {normalizer}; count it over the whole "
            f"batch (e.g. (target != ignore_index).sum()), and skip batches with nothing to count"
        )
    return normalizer / replicas if replicas > 1 else normalizer


# --- the step's loss on every rank --------------------------------------------------------

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Loss and gradient dtypes, coded 1.. in float64 exchanges (0: none), so that a rank that
holds no loss or gradient learns the dtype from the one that does."""


def share_loss(
    loss: torch.Tensor | None,
    *,
    src: int,
    group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    device: torch.device,
) -> torch.Tensor:
    """The step's loss on every rank, in the dtype ``loss_fn`` gave it (float64 for a float64
    model, bf16 for bf16 weights), the same value on every rank.

    Only the last stage's rank (global rank ``src``) has the loss. A buffer made on the other
    ranks in the default dtype, or a float32 broadcast, would give them another dtype (or, a
    float32 message into a float64 buffer, garbage): so the value travels as float64, which
    holds every float16, bfloat16 and float32 value exactly, with its dtype's code beside it,
    and every rank casts it back. On the last stage's rank the result is ``loss`` exactly. With
    data parallelism (``dp_group``) the replicas' losses are averaged in float64 before the
    cast (each replica's share is equal; gradients are averaged by DDP/FSDP)."""
    box = torch.zeros(2, dtype=torch.float64, device=device)
    if loss is not None:
        box[0] = loss.detach().to(torch.float64)
        box[1] = _DTYPES.index(loss.dtype) + 1 if loss.dtype in _DTYPES else -1
    dist.broadcast(box, src=src, group=group)
    value, code = box[:1], int(box[1].item())
    if code < 1:
        what = f"a {loss.dtype} loss" if loss is not None else f"a loss on global rank {src} of another dtype"
        raise PipelineRuntimeError(
            f"rank {dist.get_rank()}: loss_fn returned {what}; a loss must be one of "
            f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)} (cast it, e.g. .float())"
        )
    if dp_group is not None:
        dist.all_reduce(value, group=dp_group)
        value /= dist.get_world_size(dp_group)
    return value[0].to(_DTYPES[code - 1])


def replica_share(size: int, dp_group: dist.ProcessGroup, device: torch.device,
                  timeout: datetime.timedelta) -> Fraction:
    """This replica's weight in a step's average over the replicas: D · n / N for its ``size``
    n of the N samples all D replicas pass. DDP and FSDP average the replicas' gradients (and
    :func:`share_loss` their losses) equally, which is the whole batch's mean only where every
    replica has the same share: a last, smaller batch split unevenly (7 and 6 of 13) is
    weighted by scaling each replica's losses by this factor (exactly 1 where the shares are
    equal). Collective over ``dp_group`` (one all-gather of a count), every step; refuses, on
    every rank alike, a step where some replica has no sample."""
    sizes = torch.zeros(dist.get_world_size(dp_group), dtype=torch.int64, device=device)
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    gathered = list(sizes.chunk(len(sizes)))
    wait_for([dist.all_gather(gathered, mine, group=dp_group, async_op=True)], "sharing the replicas' batch sizes", timeout)
    counts = [int(t.item()) for t in gathered]
    if min(counts) < 1:
        raise InputError(
            f"step got batches of {counts} samples on the {len(counts)} data-parallel replicas (in replica "
            f"order): every replica needs at least one sample; split the last batch so that each gets "
            f"some, or drop it (drop_last=True)")
    return Fraction(len(counts) * size, sum(counts))


# --- loss scaling ---------------------------------------------------------------------------

def sharded_grad_scaler(device: torch.device, group: dist.ProcessGroup | None, **kwargs: Any) -> ShardedGradScaler:
    """A GradScaler whose inf/NaN check is all-reduced over the pipeline group."""
    return ShardedGradScaler(device.type, process_group=group if group is not None else dist.group.WORLD, **kwargs)


def scale_loss_fn(
    scaler: Any, ranks: Sequence[int], device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``scaler.scale`` if it scales and its inf/NaN check covers the pipeline's (global)
    ``ranks``; None if there is nothing to scale. Refuses a scaler that would let ranks
    disagree on skipping a step.

    Only the last stage scales a loss, but every rank's scaler must hold a scale before
    ``unscale_``/``step``: GradScaler creates it on the first ``scale`` call, so scale a one.
    """
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise InputError(f"scaler must be a torch.amp.GradScaler (see pipe.grad_scaler()), got {type(scaler).__name__}")
    if not scaler.is_enabled():
        return None
    if isinstance(scaler, ShardedGradScaler):
        group = scaler.process_group if scaler.process_group is not None else dist.group.WORLD
        members = set(dist.get_process_group_ranks(group))
        missing = sorted(set(ranks) - members)
        if missing:
            raise InputError(
                f"the scaler's process group {sorted(members)} lacks pipeline ranks {missing}, "
                f"which would skip steps on their own; use scaler = pipe.grad_scaler()"
            )
    elif len(ranks) > 1:
        raise InputError(
            f"torch.amp.GradScaler checks for inf/NaN on each of the {len(ranks)} pipeline ranks "
            f"alone, so they could disagree on skipping a step; use scaler = pipe.grad_scaler() "
            f"(a ShardedGradScaler over the pipeline group) instead"
        )
    scaler.scale(torch.ones((), device=device))
    return scaler.scale


# --- clipping -------------------------------------------------------------------------------

def _first_stages(plan: Plan) -> dict[str, int]:
    """Every parameter's first stage, in plan order (the same on every rank). A tied weight
    lives on several stages with one summed gradient: only its first stage counts it."""
    first: dict[str, int] = {}
    for s in plan.stages:
        for fqn in s.parameters:
            first.setdefault(fqn, s.index)
    return first


def total_grad_norm(
    named: Iterable[tuple[str, torch.nn.Parameter]],
    plan: Plan,
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The norm of all stages' gradients as one vector; the same value on every rank.

    ``named``: this rank's parameters under their canonical names.
    """
    norm_type = float(norm_type)
    first = _first_stages(plan)
    slots = {fqn: i for i, fqn in enumerate(first)}  # positions in the exchanged vector
    mine: list[tuple[int, torch.Tensor]] = []
    for name, p in named:
        if p.grad is None:
            continue
        if name not in first:
            raise PipelineRuntimeError(
                f"rank {rank}: parameter {name!r} has a gradient but the plan puts it on no "
                f"stage, so its norm would be missed; re-plan for this model"
            )
        if plan.rank_of(first[name]) == rank:
            mine.append((slots[name], p.grad))
    n = len(slots)
    exchange = torch.zeros(2 * n, dtype=torch.float64, device=device)
    if mine:
        grads = [g for _, g in mine]
        if any(isinstance(g, DTensor) for g in grads):  # FSDP: each norm over the replicas' shards
            norms = [_full(torch.linalg.vector_norm(g, norm_type)) for g in grads]
        elif foreach is False:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        else:
            norms = foreach_norm(grads, norm_type)
        index = torch.tensor([i for i, _ in mine], device=device)
        exchange[index] = torch.stack([x.to(device, torch.float64) for x in norms])
        codes = [float(_DTYPES.index(g.dtype) + 1) if g.dtype in _DTYPES else 3.0 for g in grads]
        exchange[index + n] = torch.tensor(codes, dtype=torch.float64, device=device)
    dist.all_reduce(exchange, group=group)  # each slot has one owner: the sum gathers them
    codes_all = exchange[n:].tolist()
    present = [i for i, c in enumerate(codes_all) if c > 0]
    if not present:
        return torch.zeros((), device=device)
    dtype = functools.reduce(torch.promote_types, {_DTYPES[int(codes_all[i]) - 1] for i in present})
    norms_all = exchange[:n][torch.tensor(present, device=device)].to(dtype)
    total = torch.linalg.vector_norm(norms_all, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        names = list(first)
        bad = [names[present[j]] for j in torch.nonzero(~torch.isfinite(norms_all)).flatten().tolist()]
        where = ", ".join(f"{f} (stage {first[f]}, rank {plan.rank_of(first[f])})" for f in bad)
        raise PipelineRuntimeError(
            f"rank {rank}: the total norm of order {norm_type} of the gradients over all stages "
            f"is {total.item()}; non-finite gradients in {where}. To clip anyway (scaling by "
            f"the non-finite norm), pass error_if_nonfinite=False"
        )
    return total


def clip_grad_norm_(
    named: Sequence[tuple[str, torch.nn.Parameter]],
    plan: Plan,
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over all stages: every rank scales its gradients (a
    tied weight's copies included) by the same coefficient and returns the same total norm."""
    total = total_grad_norm(named, plan, rank, group, device, norm_type, error_if_nonfinite, foreach)
    sharded = [p for _, p in named if isinstance(p.grad, DTensor)]
    if not sharded:
        torch.nn.utils.clip_grads_with_norm_([p for _, p in named], max_norm, total, foreach)
        return total
    # FSDP: scale each rank's shards by the coefficient torch's clip_grads_with_norm_ computes
    # (its foreach kernels refuse DTensor gradients beside a plain total).
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for _, p in named:
            if p.grad is not None:
                _local(p.grad).mul_(coef.to(p.grad.device))
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """A norm computed on a DTensor as a plain tensor (the reduction over shards is a
    collective over the gradient's mesh: every replica of the stage runs it in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
