"""docs/training-loop.md's training loop at 4 ranks, under GPipe, 1F1B and zero-bubble: every feature of an
ordinary loop matches the plain model (2-rank coverage of each feature is in test_amp_shapes,
test_eval, test_grads and test_model_state).

One fork of 4 ranks runs, per schedule, on the GPT example (tied input/output embeddings across
the first and last stage), whose weights each rank builds from its own seed (compile must give
every rank rank 0's): a bf16 autocast step, an fp16 step with the pipeline's GradScaler, a
clipped step, a smaller last batch, an eval step under no_grad with outputs, the merged state
dict loaded strictly into the plain model, and a token-averaged loss with padding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipecut
from examples import gpt
from tests.harness import run_ranks
from tests.reference import ATOL, COUNTED, RTOL, assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist

SCHEDULES = ("gpipe", "1f1b", "zero-bubble")
M = 4


def _gpt() -> Any:
    return gpt.build(batch_size=8, vocab=128, dim=64, heads=4, layers=4, seq=16)


def _seeded(rank: int) -> Any:
    """Rank r's model from seed r (a common script bug), the batch from seed 0 on every rank."""
    model = _gpt_model(rank)
    _, inputs, loss_fn, target = _gpt()
    return model, inputs, loss_fn, target


def _gpt_model(seed: int) -> Any:
    return gpt.build(batch_size=8, seed=seed, vocab=128, dim=64, heads=4, layers=4, seq=16)[0]


def _padded() -> Any:
    """The GPT batch with -100 padding at the end of uneven rows (valid tokens differ per row)."""
    model, inputs, _, target = _gpt()
    target = target.clone()
    for row, keep in enumerate((16, 3, 9, 16, 1, 12, 7, 16)):
        target[row, keep:] = -100
    return model, inputs, _summed, target


def _summed(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100,
                                             reduction="sum")


def _cut(batch: Any, rows: int) -> Any:
    return tuple(t[:rows] for t in batch) if isinstance(batch, tuple) else batch[:rows]


def _ranks(rank: int, world: int) -> list[dict[str, Any]]:
    out = []
    for schedule in SCHEDULES:
        model, inputs, loss_fn, target = _seeded(rank)
        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
            schedule=schedule, measure=COUNTED,
            runtime=pipecut.RuntimeOptions(timeout=120),
        )
        res: dict[str, Any] = {}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res["bf16"] = {"loss": pipe.step(inputs, target), "grads": pipeline_grads(model, pipe)}
        for p in pipe.parameters():
            p.grad = None
        scaler = pipe.grad_scaler(init_scale=2.0**10)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.0)  # lr 0: the step must not move weights
        with torch.autocast("cpu", dtype=torch.float16):
            loss16 = pipe.step(inputs, target, scaler=scaler)
        scaler.unscale_(opt)
        res["fp16"] = {"loss": loss16, "grads": pipeline_grads(model, pipe)}
        scaler.step(opt)
        scaler.update()
        res["fp16_scale"] = scaler.get_scale()
        for p in pipe.parameters():
            p.grad = None
        loss = pipe.step(inputs, target)
        norm = pipe.clip_grad_norm_(0.5)
        res["clipped"] = {"loss": loss, "grads": pipeline_grads(model, pipe), "norm": norm}
        for p in pipe.parameters():
            p.grad = None
        res["smaller"] = {"loss": pipe.step(_cut(inputs, 6), _cut(target, 6)), "grads": pipeline_grads(model, pipe)}
        for p in pipe.parameters():
            p.grad = None
        pipe.eval()
        with torch.no_grad():
            val, logits = pipe.step(inputs, target, return_outputs=True, all_ranks=True)
        res["eval"] = {"loss": val, "logits": logits, "no_grads": all(p.grad is None for p in pipe.parameters())}
        pipe.train()
        res["state"] = pipe.state_dict()
        model, inputs, _, target = _padded()
        summed = pipecut.compile(
            model, inputs, world, loss_fn=_summed, target=target, microbatches=M,
            schedule=schedule, measure=COUNTED,
            runtime=pipecut.RuntimeOptions(timeout=120, loss_reduction="sum"),
        )
        tokens = summed.step(inputs, target, normalizer=(target != -100).sum())
        res["tokens"] = {"loss": tokens, "grads": pipeline_grads(model, summed)}
        out.append(res)
    return out


def _clipped_reference() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    model, inputs, loss_fn, target = _gpt()
    loss = loss_fn(model(*inputs), target)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    names = {id(p): n for n, p in model.named_parameters()}
    return loss.detach(), {names[id(p)]: p.grad for p in model.parameters()}, norm


@pytest.mark.timeout(420)
def test_training_loop_at_four_ranks_matches_plain_model() -> None:
    per_rank = run_ranks(_ranks, 4, timeout=400)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_loss, bf16_grads = reference(_gpt, M, per_microbatch=False)
    with torch.autocast("cpu", dtype=torch.float16):
        fp16_loss, fp16_grads = reference(_gpt, M, per_microbatch=False)
    model, inputs, _, target = _padded()
    mean = torch.nn.functional.cross_entropy(model(*inputs).flatten(0, 1), target.flatten(), ignore_index=-100)
    mean.backward()
    token_grads = {n: p.grad for n, p in model.named_parameters()}
    loss, grads, norm = _clipped_reference()
    small_loss, small_grads = reference(lambda: (lambda m, x, f, y: (m, _cut(x, 6), f, _cut(y, 6)))(*_gpt()), M, False)
    model, inputs, loss_fn, target = _gpt()
    model.eval()
    with torch.no_grad():
        ref_logits = model(*inputs)
        ref_val = loss_fn(ref_logits, target)
    for i, schedule in enumerate(SCHEDULES):
        results = [rank[i] for rank in per_rank]
        # bf16: see AMP_RTOL in test_amp_shapes.py (rounding order differs by microbatch).
        scale = max(g.abs().max().item() for g in bf16_grads.values())
        assert_parity(bf16_loss, bf16_grads, [r["bf16"] for r in results], rtol=1e-2, atol=1e-2 * scale)
        scale16 = max(g.abs().max().item() for g in fp16_grads.values())
        assert_parity(fp16_loss, fp16_grads, [r["fp16"] for r in results], rtol=2e-3, atol=2e-3 * scale16)
        assert {r["fp16_scale"] for r in results} == {2.0**10}  # no inf: every rank kept the scale
        assert_parity(mean.detach(), token_grads, [r["tokens"] for r in results])
        assert_parity(loss, grads, [r["clipped"] for r in results])
        for r in results:
            torch.testing.assert_close(r["clipped"]["norm"], norm, rtol=RTOL, atol=ATOL, msg=schedule)
        assert_parity(small_loss, small_grads, [r["smaller"] for r in results])
        for r in results:
            assert r["eval"]["no_grads"], schedule
            torch.testing.assert_close(r["eval"]["loss"], ref_val, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(r["eval"]["logits"], ref_logits, rtol=RTOL, atol=ATOL)
        merged: dict[str, torch.Tensor] = {}
        for r in results:
            merged.update(r["state"])
        fresh = gpt.GPT(vocab=128, dim=64, heads=4, layers=4, seq=16)
        fresh.load_state_dict(merged, strict=True)  # the model's own names, every key
        for name, value in model.state_dict().items():
            torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0, msg=name)
