"""The single-process reference every parity test compares against, and the comparison itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import pipecut
from pipecut.core.batching import split_microbatches
from pipecut.core.graph import canonical_names
from pipecut.core.kinds import Recompute
from pipecut.ir import Plan

# fp32 tolerances: the pipeline runs the same kernels on the same microbatches; what differs is
# the order in which per-microbatch gradients (and, against a full-batch reference, the
# reduction inside each matmul) are summed. Those reorderings change results by a few ulps per
# addition, ~1e-6 relative over the reductions of these small models; 1e-5 leaves a margin of
# 10x while still catching any real error (a missing or doubled term is O(1) relative).
RTOL = 1e-5
ATOL = 1e-6

COUNTED = pipecut.MeasureOptions(estimate="A100-80GB")
"""How parity tests plan (``measure=COUNTED``): node costs counted and priced on a device
profile, no clock read, so the split, and with it the order in which gradients are summed, is
the same on every run whatever the machine's load. (Planned from timings, one test split a GPT
73/82 nodes in one run and 81/74 in the next, under another process's load.) The device is only
a fixed price list here: nothing runs on it."""


def reference(
    build: Callable[[], tuple[torch.nn.Module, Any, Callable[..., torch.Tensor], Any]],
    microbatches: int,
    per_microbatch: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of the unsplit model: full batch, or microbatch by microbatch
    (GPipe semantics, needed where BatchNorm statistics depend on the batch)."""
    model, inputs, loss_fn, target = build()
    names = canonical_names(model)
    if per_microbatch:
        size = target.shape[0]
        xs = split_microbatches(inputs, microbatches, size)
        ts = split_microbatches(target, microbatches, size)
        loss = sum(_call(model, x, loss_fn, t) for x, t in zip(xs, ts)) / microbatches
    else:
        loss = _call(model, inputs, loss_fn, target)
    loss.backward()
    grads = {names[id(p)]: p.grad for p in model.parameters() if p.requires_grad}
    return loss.detach(), grads


def _call(model: torch.nn.Module, inputs: Any, loss_fn: Callable[..., torch.Tensor], target: Any) -> torch.Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return loss_fn(out, target)


def pipeline_grads(model: torch.nn.Module, pipe: Any) -> dict[str, torch.Tensor]:
    """This rank's gradients keyed by canonical parameter name."""
    names = canonical_names(model)
    return {names[id(p)]: p.grad.detach().clone() for p in pipe.parameters() if p.grad is not None}


def assert_parity(
    ref_loss: torch.Tensor,
    ref_grads: dict[str, torch.Tensor],
    rank_results: list[dict[str, Any]],
    rtol: float = RTOL,
    atol: float = ATOL,
) -> None:
    """Every rank returned the reference loss; every parameter's gradient matches."""
    merged: dict[str, torch.Tensor] = {}
    for r, res in enumerate(rank_results):
        torch.testing.assert_close(res["loss"], ref_loss, rtol=rtol, atol=atol, msg=lambda m, r=r: f"rank {r} loss: {m}")
        for name, g in res["grads"].items():
            if name in merged:  # a tied parameter: both stages must hold the summed gradient
                torch.testing.assert_close(g, merged[name], rtol=rtol, atol=atol)
            merged[name] = g
    missing = sorted(set(ref_grads) - set(merged))
    assert not missing, f"no rank returned gradients for {missing}"
    for name, ref in ref_grads.items():
        torch.testing.assert_close(merged[name], ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def named_grads(pipe: Any) -> dict[str, torch.Tensor | None]:
    """This rank's gradients under the model's names, None where a parameter has none; FSDP's
    shards gathered whole (collective over "dp": every rank calls it at the same point)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor | None] = {}
    for name, p in pipe.named_parameters():
        g = p.grad
        out[name] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def assert_named_grads(want: dict[str, torch.Tensor | None], ranks: list[dict[str, torch.Tensor | None]],
                       at: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every rank's :func:`named_grads` against the plain model's: the copies of one parameter
    (replicas, a tied weight's stages) agree, every parameter is on some rank, a frozen one
    (None in ``want``) has no gradient anywhere, and every other matches."""
    merged: dict[str, torch.Tensor | None] = {}
    for grads in ranks:
        for name, g in grads.items():
            if name in merged:
                other = merged[name]
                assert (g is None) == (other is None), f"{at}: {name} has a gradient on some of its ranks only"
                if g is not None:
                    torch.testing.assert_close(g, other, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{at} {n} copies: {m}")
            merged[name] = g
    assert merged.keys() == want.keys(), (at, sorted(merged.keys() ^ want.keys()))
    for name, ref in want.items():
        have = merged[name]
        if ref is None:  # frozen: as in the plain model, no gradient at all
            assert have is None, f"{at}: frozen {name} has a gradient"
            continue
        assert have is not None, f"{at}: {name} has no gradient"
        torch.testing.assert_close(have, ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{at} {n}: {m}")


def recompute_blocks(plan: Plan, prefix: str, count: int) -> Plan:
    """``plan`` with each stage recomputing its first ``count`` blocks ``prefix``.N (all of
    their nodes, including the modules inside them)."""
    depth = prefix.count(".") + 2

    def block(name: str) -> str | None:
        module = plan.node(name).module
        return ".".join(module.split(".")[:depth]) if module.startswith(prefix + ".") else None

    stages = []
    for s in plan.stages:
        chosen = set(list(dict.fromkeys(b for n in s.nodes if (b := block(n)) is not None))[:count])
        names = tuple(n for n in s.nodes if block(n) in chosen)
        stages.append(dataclasses.replace(s, recompute=Recompute.SELECTIVE, recomputed=names) if names else s)
    return dataclasses.replace(plan, stages=tuple(stages))


def recompute_whole(plan: Plan) -> Plan:
    """``plan`` with every stage recomputing all of its forward in backward."""
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=Recompute.FULL) for s in plan.stages))
