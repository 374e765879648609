"""Gradient accumulation is exact: several ``pipe.step`` calls before ``opt.step()`` leave every
``.grad`` equal to the plain model's accumulated gradient (``pipecut.runtime.grads.tied``).

The trap was the tied weight: its copies on the first and last stage were summed whole after
every step, so the first step's contribution was counted once per stage after the second step.
Each scenario runs two accumulation windows on different batches (three steps, ``opt``-style
``zero_grad``, then two steps) and compares the gradients after each window:

- every schedule on the tied GPT (GPipe, 1F1B, zero-bubble and ZBV weight passes, interleaved),
  with and without ``pipe.no_sync()`` on the steps before the last;
- whole-stage recompute, the LM head in pieces on both stages (a tied weight of its own kind),
  ``loss_reduction="sum"`` with a normaliser per step;
- DDP and FSDP2 replicas (2 × 2 on four ranks), with and without ``no_sync``.

Refused: clipping while ``no_sync`` steps are unreduced.

Tolerances: fp32 with the same kernels (tests/reference.py); accumulating adds one more
reordered sum per step, well inside the 10x margin those tolerances leave.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import pipecut
from examples import gpt
from pipecut.core.kinds import Recompute
from pipecut.ir import ChunkedNode, Plan
from tests.harness import run_ranks
from tests.multiprocess.test_chunked_head import _set_plan
from tests.multiprocess.test_grads import PAD, token_sum
from tests.multiprocess.test_hybrid import _aliases, _full_grads
from tests.reference import ATOL, COUNTED, RTOL, assert_parity, pipeline_grads

pytestmark = pytest.mark.dist

M = 4
WINDOWS = (3, 2)
"""Steps per accumulation window; ``zero_grad`` between windows."""


def _model(layers: int = 2, vocab: int = 64) -> tuple[Any, ...]:
    return gpt.build(8, seed=0, vocab=vocab, dim=32, heads=2, layers=layers, seq=16)


def _batches(n: int, vocab: int = 64, pad: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batch i of the run: fresh tokens (seed 100 + i); with ``pad``, an uneven number of padded
    target positions per row, different per batch."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        tokens = torch.randint(0, vocab, (8, 17), generator=g)
        target = tokens[:, 1:].clone()
        if pad:
            for row in range(8):
                cut = (row * 5 + i * 3) % 13
                if cut:
                    target[row, -cut:] = PAD
        out.append((tokens[:, :-1], target))
    return out


def _normalizer(target: torch.Tensor) -> torch.Tensor:
    return (target != PAD).sum()


def reference(layers: int, vocab: int, loss: str) -> list[dict[str, Any]]:
    """The plain model's loss of each step and the gradients at the end of each window."""
    model, _, lm_loss, _ = _model(layers, vocab)
    names = {id(p): n for n, p in model.named_parameters()}
    batches = iter(_batches(sum(WINDOWS), vocab, pad=loss == "sum"))
    out = []
    for steps in WINDOWS:
        losses = []
        for _ in range(steps):
            x, t = next(batches)
            value = token_sum(model(x), t) / _normalizer(t) if loss == "sum" else lm_loss(model(x), t)
            value.backward()
            losses.append(value.detach())
        out.append({"losses": losses, "grads": {names[id(p)]: p.grad.clone() for p in model.parameters()}})
        model.zero_grad(set_to_none=True)
    return out


def _windows(pipe: Any, model: Any, vocab: int, loss: str, no_sync: bool,
             grads: Callable[[Any, Any], dict[str, torch.Tensor]] = pipeline_grads,
             share: slice = slice(None)) -> list[dict[str, Any]]:
    batches = iter(_batches(sum(WINDOWS), vocab, pad=loss == "sum"))
    out = []
    for steps in WINDOWS:
        losses = []
        for i in range(steps):
            x, t = next(batches)
            kw = {"normalizer": _normalizer(t)} if loss == "sum" else {}
            if no_sync and i < steps - 1:
                with pipe.no_sync():
                    losses.append(pipe.step((x[share],), t[share], **kw))
            else:
                losses.append(pipe.step((x[share],), t[share], **kw))
        out.append({"losses": losses, "grads": grads(model, pipe)})
        for p in pipe.parameters():
            p.grad = None  # opt.zero_grad()
    return out


def _compile(world: Any, layers: int, vocab: int, loss: str, plan: Plan | None = None,
             **kw: Any) -> tuple[Any, Any]:
    model, inputs, lm_loss, target = _model(layers, vocab)
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=token_sum if loss == "sum" else lm_loss,
        target=target, microbatches=M, plan=plan,
        runtime=pipecut.RuntimeOptions(timeout=60, loss_reduction="sum" if loss == "sum" else "mean"),
        measure=COUNTED, **kw,
    )
    return model, pipe


TWO_RANKS = [  # (name, layers, vocab, loss, compile keywords)
    ("gpipe", 2, 64, "mean", {"schedule": "gpipe"}),
    ("1f1b", 2, 64, "mean", {"schedule": "1f1b"}),
    ("zero-bubble", 2, 64, "mean", {"schedule": "zero-bubble"}),
    ("zbv", 4, 64, "mean", {"schedule": "zbv", "scheduling": pipecut.ScheduleOptions(stages_per_rank=2)}),
    ("interleaved", 4, 64, "mean", {"schedule": "interleaved-1f1b",
                                        "scheduling": pipecut.ScheduleOptions(stages_per_rank=2)}),
    ("sum", 2, 64, "sum", {"schedule": "1f1b"}),
]


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, layers, vocab, loss, kw in TWO_RANKS:
        for no_sync in (False, True):
            model, pipe = _compile(world, layers, vocab, loss, **kw)
            out[name, no_sync] = _windows(pipe, model, vocab, loss, no_sync)
            out[name, "tied"] = [t.stages for t in pipe.plan.tied]
    model, pipe = _compile(world, 2, 64, "mean", schedule="1f1b")
    whole = dataclasses.replace(pipe.plan, stages=tuple(
        dataclasses.replace(s, recompute=Recompute.FULL) for s in pipe.plan.stages))
    model, pipe = _compile(world, 2, 64, "mean", plan=whole)
    out["recompute", True] = _windows(pipe, model, 64, "mean", no_sync=True)
    pieces = _set_plan(lambda: _model(2, 1024), (ChunkedNode(node="lm_head", pieces=2),), k=2)
    model, pipe = _compile(world, 2, 1024, "mean", plan=pieces)
    out["pieces", True] = _windows(pipe, model, 1024, "mean", no_sync=True)
    out["pieces", "tied"] = [t.stages for t in pipe.plan.tied]

    with pipe.no_sync():
        x, t = _batches(1, 1024)[0]
        pipe.step((x,), t)
    with pytest.raises(pipecut.PipelineRuntimeError, match=r"clip_grad_norm_ after steps under no_sync"):
        pipe.clip_grad_norm_(1.0)
    pipe.step((x,), t)
    out["clip_after_sync"] = pipe.clip_grad_norm_(1.0)  # allowed once the window is reduced
    return out


def _check(results: list[list[dict[str, Any]]], ref: list[dict[str, Any]]) -> None:
    for window, want in enumerate(ref):
        for r in results:
            for got, loss in zip(r[window]["losses"], want["losses"]):
                torch.testing.assert_close(got, loss, rtol=RTOL, atol=ATOL)
        assert_parity(want["losses"][-1], want["grads"],
                      [{"loss": r[window]["losses"][-1], "grads": r[window]["grads"]} for r in results])


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_two_ranks, 2, timeout=400)


@pytest.mark.parametrize("name, layers, vocab, loss, kw", TWO_RANKS)
@pytest.mark.parametrize("no_sync", [False, True])
def test_accumulated_gradients_match_on_every_schedule(
    two_ranks: list[dict[str, Any]], name: str, layers: int, vocab: int, loss: str, kw: Any, no_sync: bool
) -> None:
    assert two_ranks[0][name, "tied"], "the scenario must tie a weight across stages"
    _check([r[name, no_sync] for r in two_ranks], reference(layers, vocab, loss))


@pytest.mark.parametrize("name, vocab", [("recompute", 64), ("pieces", 1024)])
def test_accumulated_gradients_match_with_recompute_and_head_pieces(
    two_ranks: list[dict[str, Any]], name: str, vocab: int
) -> None:
    _check([r[name, True] for r in two_ranks], reference(2, vocab, "mean"))
    if name == "pieces":
        assert two_ranks[0]["pieces", "tied"] == [(0, 1)]  # the embedding, also the pieces' weight


def test_clipping_is_refused_until_the_window_is_reduced(two_ranks: list[dict[str, Any]]) -> None:
    assert two_ranks[0]["clip_after_sync"].item() == two_ranks[1]["clip_after_sync"].item() > 0


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    share = slice(4 * replica, 4 * replica + 4)
    out: dict[str, Any] = {}
    for kind in ("ddp", "fsdp"):
        for no_sync in (False, True):
            model, inputs, lm_loss, target = _model()
            alias = _aliases(model)
            pipe = pipecut.compile(
                model, (inputs[0][share],), mesh, loss_fn=lm_loss,
                target=target[share], microbatches=2, data_parallel=kind, schedule="1f1b",
                runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED,
            )
            out[kind, no_sync] = _windows(pipe, model, 64, "mean", no_sync,
                                          grads=lambda _, p, alias=alias: _full_grads(alias, p), share=share)
    return out


@pytest.mark.timeout(400)
def test_accumulated_gradients_match_with_ddp_and_fsdp_replicas() -> None:
    results = run_ranks(_four_ranks, 4, timeout=380)
    ref = reference(2, 64, "mean")
    for kind in ("ddp", "fsdp"):
        for no_sync in (False, True):
            # Each replica's loss is its half's, averaged over replicas: the whole batch's.
            _check([r[kind, no_sync] for r in results], ref)
