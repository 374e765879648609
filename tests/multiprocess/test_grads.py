"""Gradient post-processing across stages equals the unsplit model's (``pipecut.runtime.grads.collective``).

- ``pipe.clip_grad_norm_`` returns ``torch.nn.utils.clip_grad_norm_``'s total norm of the plain
  model on every rank (bitwise the same on all ranks), for norm types 2, 1 and inf, counts the
  tied GPT embedding once, and leaves every gradient clipped as torch clips the plain model's;
  max_norm is half the norm, so clipping is active. GPipe, 1F1B, zero-bubble, interleaved
  (4 virtual stages on 2 ranks); K=2 and K=4.
- ``pipe.grad_scaler()``: an inf (then a NaN) injected into ONE stage's gradients makes every
  rank skip the step and back off the scale identically; a clean step then matches the plain
  model's SGD step. A plain ``torch.amp.GradScaler`` is refused. All in fp32: autocast fp16
  through the pipeline is another change's subject.
- ``loss_reduction="sum"`` with ``normalizer=`` valid tokens gives ``F.cross_entropy(...,
  ignore_index=-100)`` of the whole batch (loss and every gradient) with padding uneven across
  microbatches, where the mean of microbatch means would not; also under data parallelism.

Everything runs in one forked 2-rank run and one 4-rank run; references are computed in the
parent beforehand (forked ranks inherit them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import pipecut
from examples import gpt, mlp
from pipecut.core.graph import canonical_names
from tests.harness import run_ranks
from tests.reference import ATOL, COUNTED, RTOL, assert_parity, pipeline_grads

pytestmark = pytest.mark.dist

NORMS = (2.0, 1.0, math.inf)
PAD = -100


def small_mlp(batch_size: int = 8):
    return mlp.build(batch_size, width=64, depth=4)


def small_gpt(batch_size: int = 8, layers: int = 2):
    return gpt.build(batch_size, vocab=64, dim=32, heads=2, layers=layers, seq=16)


def gpt4(batch_size: int = 8):
    return small_gpt(batch_size, layers=4)


def padded_gpt(batch_size: int = 8):
    """Targets padded with -100 unevenly: microbatches of 2 rows hold 29, 10, 19, 23 valid tokens."""
    model, inputs, _, target = small_gpt(batch_size)
    target = target.clone()
    for row, pad in enumerate([0, 3, 15, 7, 12, 1, 0, 9]):
        if pad:
            target[row, -pad:] = PAD
    return model, inputs, token_sum, target


def token_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD, reduction="sum")


def token_mean(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD)


FACTORIES: dict[str, Callable[..., Any]] = {"mlp": small_mlp, "gpt": small_gpt, "gpt4": gpt4}


def _plain(build: Callable[..., Any], loss_fn: Callable[..., torch.Tensor] | None = None):
    model, inputs, default_loss, target = build()
    loss = (loss_fn or default_loss)(model(*inputs), target)
    loss.backward()
    return model, loss.detach()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = canonical_names(model)
    return {names[id(p)]: p.grad.clone() for p in model.parameters() if p.grad is not None}


def clip_reference(name: str) -> dict[float, dict[str, Any]]:
    """Per norm type: the plain model's loss, total norm, max_norm (half of it) and clipped grads."""
    out = {}
    for p in NORMS:
        model, loss = _plain(FACTORIES[name])
        unclipped = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()], p)
        max_norm = 0.5 * unclipped.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, p)
        out[p] = {"loss": loss, "norm": norm, "max_norm": max_norm, "grads": _grads(model)}
    return out


def _clip_scenario(world: int, name: str, schedule: str, ref: dict[float, dict[str, Any]],
                   foreach: bool | None = None, **kw: Any):
    model, inputs, loss_fn, target = FACTORIES[name]()
    pipe = pipecut.compile(
        model, inputs, kw.pop("devices", world), loss_fn=loss_fn, target=target,
        microbatches=4, schedule=schedule, runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED, **kw,
    )
    results = {}
    for p in NORMS:
        for q in pipe.parameters():
            q.grad = None
        loss = pipe.step(inputs, target)
        norm = pipe.clip_grad_norm_(ref[p]["max_norm"], p, foreach=foreach)
        results[p] = {"loss": loss, "norm": norm, "grads": pipeline_grads(model, pipe)}
    results["tied"] = [t.stages for t in pipe.plan.tied]
    return pipe, results


def _check_clip(per_rank: list[dict[float, Any]], ref: dict[float, dict[str, Any]]) -> None:
    for p in NORMS:
        ranks = [r[p] for r in per_rank]
        for r in ranks[1:]:  # the same coefficient everywhere needs the same norm everywhere
            assert torch.equal(r["norm"], ranks[0]["norm"]), (p, [x["norm"] for x in ranks])
        torch.testing.assert_close(ranks[0]["norm"], ref[p]["norm"], rtol=RTOL, atol=ATOL)
        assert_parity(ref[p]["loss"], ref[p]["grads"], ranks)


def _scaler_scenario(rank: int, world: int) -> dict[str, Any]:
    """Scale 2^10 grows every clean step (growth_interval=1) and halves on a skipped one.
    Zero-bubble: the last stage's split backward starts from the scaled loss too."""
    model, inputs, loss_fn, target = small_mlp()
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=4,
        schedule="zero-bubble", runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED,
    )
    with pytest.raises(pipecut.InputError, match="checks for inf/NaN on each of the 2 pipeline ranks"):
        pipe.step(inputs, target, scaler=torch.amp.GradScaler("cpu"))
    scaler = pipe.grad_scaler(init_scale=2.0**10, growth_interval=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    first = next(iter(pipe.parameters()))
    out: dict[str, Any] = {"scales": [], "stepped": []}
    for bad_rank, bad in ((1, math.inf), (0, math.nan), (None, 0.0)):
        opt.zero_grad()
        loss = pipe.step(inputs, target, scaler=scaler)
        out.setdefault("loss", loss)
        out.setdefault("scaled_grads", pipeline_grads(model, pipe))
        if rank == bad_rank:
            first.grad.view(-1)[0] = bad  # one stage only: every rank must still skip
        scaler.unscale_(opt)
        if bad_rank is None:
            out["unscaled_grads"] = pipeline_grads(model, pipe)
        before = [q.detach().clone() for q in pipe.parameters()]
        scaler.step(opt)
        scaler.update()
        out["stepped"].append(any(not torch.equal(a, q) for a, q in zip(before, pipe.parameters())))
        out["scales"].append(scaler.get_scale())
    out["params"] = {n: q.detach().clone() for n, q in pipe.named_parameters()}
    return out


def _token_scenario(world: int, pipe: Any) -> dict[str, Any]:
    """Token-averaged loss with loss_reduction='sum', reusing the GPT plan (same graph)."""
    model, inputs, _, target = padded_gpt()
    tokens = pipecut.compile(
        model, inputs, world, loss_fn=token_sum, target=target, microbatches=4,
        plan=pipe.plan, runtime=pipecut.RuntimeOptions(loss_reduction="sum", timeout=60),
    )
    with pytest.raises(pipecut.InputError, match="normalizer must be finite and > 0"):
        tokens.step(inputs, target, normalizer=0)
    with pytest.raises(pipecut.InputError, match="compiled with loss_reduction='mean'"):
        pipe.step(inputs, target, normalizer=10)
    total = tokens.step(inputs, target)  # no normalizer: the sum over the whole batch
    for q in tokens.parameters():
        q.grad = None
    loss = tokens.step(inputs, target, normalizer=(target != PAD).sum())
    return {"loss": loss, "grads": pipeline_grads(model, tokens), "sum": total}


def _nonfinite_scenario(rank: int, pipe: Any, inputs: Any, target: Any) -> dict[str, Any]:
    for q in pipe.parameters():
        q.grad = None
    pipe.step(inputs, target)
    names, tied = canonical_names(pipe.captured.gm), {t.fqn for t in pipe.plan.tied}
    bad = next(q for q in pipe.parameters() if names[id(q)] not in tied)
    if rank == 1:  # a weight held by one stage only (copies of a tied weight are always equal)
        bad.grad.view(-1)[0] = math.inf
    with pytest.raises(pipecut.PipelineRuntimeError, match=r"is inf; non-finite gradients in .*\(stage 1, rank 1\)") as e:
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    return {"norm": pipe.clip_grad_norm_(1.0), "error": str(e.value), "bad": names[id(bad)]}


def _two_ranks(rank: int, world: int, refs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _, out["mlp-gpipe"] = _clip_scenario(world, "mlp", "gpipe", refs["mlp"])
    gpt_pipe, out["gpt-1f1b"] = _clip_scenario(world, "gpt", "1f1b", refs["gpt"])
    _, out["gpt-zero-bubble"] = _clip_scenario(world, "gpt", "zero-bubble", refs["gpt"])
    _, out["gpt-interleaved"] = _clip_scenario(world, "gpt", "interleaved-1f1b", refs["gpt"],
                                               foreach=False, scheduling=pipecut.ScheduleOptions(stages_per_rank=2))
    out["scaler"] = _scaler_scenario(rank, world)
    out["tokens"] = _token_scenario(world, gpt_pipe)
    _, inputs, _, target = small_gpt()
    out["nonfinite"] = _nonfinite_scenario(rank, gpt_pipe, inputs, target)
    return out


def token_reference() -> dict[str, Any]:
    model, loss = _plain(padded_gpt, token_mean)
    _, total = _plain(padded_gpt, token_sum)
    # The test only means something if the mean of microbatch means is not the answer.
    m2, inputs, _, target = padded_gpt()
    logits = m2(*inputs)
    naive = sum(token_mean(logits[i : i + 2], target[i : i + 2]) for i in range(0, 8, 2)) / 4
    assert abs(naive.item() - loss.item()) > 1e-3 * loss.item(), (naive, loss)
    return {"loss": loss, "grads": _grads(model), "sum": total}


def sgd_reference(lr: float = 0.5) -> dict[str, torch.Tensor]:
    model, _ = _plain(small_mlp)
    with torch.no_grad():
        for q in model.parameters():
            q -= lr * q.grad
    return {n: q.detach() for n, q in model.named_parameters()}


@pytest.mark.timeout(300)
def test_clipping_scaling_and_token_losses_at_two_ranks() -> None:
    refs = {"mlp": clip_reference("mlp"), "gpt": clip_reference("gpt")}
    results = run_ranks(_two_ranks, 2, refs, timeout=280)
    _check_clip([r["mlp-gpipe"] for r in results], refs["mlp"])
    _check_clip([r["gpt-1f1b"] for r in results], refs["gpt"])
    _check_clip([r["gpt-zero-bubble"] for r in results], refs["gpt"])
    _check_clip([r["gpt-interleaved"] for r in results], refs["gpt"])
    assert results[0]["gpt-1f1b"]["tied"] == [(0, 1)]  # the embedding on both stages, counted once
    assert results[0]["gpt-interleaved"]["tied"] == [(0, 3)]  # stage 3 runs on rank 1

    model, loss = _plain(small_mlp)
    grads = _grads(model)
    scaler = [r["scaler"] for r in results]
    for s in scaler:
        # inf on rank 1, NaN on rank 0: both ranks skip and halve; the clean step grows it back.
        assert s["stepped"] == [False, False, True], s["stepped"]
        assert s["scales"] == [512.0, 256.0, 512.0], s["scales"]
    scaled = {n: g * 2.0**10 for n, g in grads.items()}  # scaling by a power of two is exact
    assert_parity(loss, scaled, [{"loss": s["loss"], "grads": s["scaled_grads"]} for s in scaler])
    assert_parity(loss, grads, [{"loss": s["loss"], "grads": s["unscaled_grads"]} for s in scaler])
    after = sgd_reference()
    for s in scaler:
        for n, q in s["params"].items():
            torch.testing.assert_close(q, after[n], rtol=RTOL, atol=ATOL)

    tokens = token_reference()
    assert_parity(tokens["loss"], tokens["grads"], [r["tokens"] for r in results])
    for r in results:
        torch.testing.assert_close(r["tokens"]["sum"], tokens["sum"], rtol=RTOL, atol=ATOL)
        assert r["nonfinite"]["norm"].item() == math.inf
        assert f"in {results[1]['nonfinite']['bad']} (stage 1" in r["nonfinite"]["error"]  # rank 1's


def _four_ranks(rank: int, world: int, refs: dict[str, Any]) -> dict[str, Any]:
    _, clip = _clip_scenario(world, "gpt4", "zero-bubble", refs["gpt4"])
    # 2 replicas x 2 stages: each replica trains on half the padded batch; the normaliser counts
    # the whole batch; after averaging, replicas hold equal gradients and clip alike.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    half = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4)
    model, inputs, _, target = padded_gpt()
    local = (inputs[0][half],)
    pipe = pipecut.compile(
        model, local, mesh, loss_fn=token_sum, target=target[half], microbatches=2,
        runtime=pipecut.RuntimeOptions(loss_reduction="sum", timeout=60), measure=COUNTED,
    )
    loss = pipe.step(local, target[half], normalizer=(target != PAD).sum())
    norm = pipe.clip_grad_norm_(refs["tokens"]["max_norm"])
    return {"clip": clip, "dp": {"loss": loss, "norm": norm, "grads": pipeline_grads(model, pipe)}}


@pytest.mark.timeout(300)
def test_four_stages_and_data_parallel_replicas() -> None:
    model, loss = _plain(padded_gpt, token_mean)
    unclipped = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5 * unclipped.item())
    refs = {"gpt4": clip_reference("gpt4"), "tokens": {"max_norm": 0.5 * unclipped.item()}}
    results = run_ranks(_four_ranks, 4, refs, timeout=280)
    _check_clip([r["clip"] for r in results], refs["gpt4"])
    assert results[0]["clip"]["tied"] == [(0, 3)]
    dp = [r["dp"] for r in results]
    for r in dp:
        torch.testing.assert_close(r["norm"], norm, rtol=RTOL, atol=ATOL)
    assert_parity(loss.detach(), _grads(model), dp)
