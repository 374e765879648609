"""The user's model state under compile, on 2 forked ranks, in one run:

- ranks seeded differently train rank 0's model (compile sends every rank rank 0's weights),
  plain and interleaved (two stages per rank);
- names: on Hugging Face GPT-2 (tied), BERT (tied) and T5 (three aliases of one embedding, a
  constant lifted by torch.export), ``named_parameters``/``named_buffers``/``state_dict`` use
  the model's own names, and the ranks' state dicts merged load into the plain model with
  ``strict=True``;
- a buffer reassigned in forward (``self.calls += 1``) counts as in the plain model, and the
  loss and gradients match; compile leaves the user's model and inputs as they were (that
  model, and BatchNorm);
- a model writing into its input is refused on every rank (none waits for the others), and
  ``compile(plan=..., microbatches=...)`` that contradicts the plan is a PlanError.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import pipecut
from examples import gpt, resnet, zoo
from pipecut.errors import CaptureError, PlanError
from pipecut.runtime.comm import sync
from tests.harness import run_ranks
from tests.reference import COUNTED, assert_parity, pipeline_grads, reference
from tests.stateful import assert_unchanged, counts_calls, snapshot, writes_input

pytestmark = pytest.mark.dist

GPT = functools.partial(gpt.build, vocab=64, dim=32, heads=2, layers=4, seq=16, batch_size=8)
NAMED = {"gpt2": zoo.gpt2, "bert": zoo.bert, "t5": zoo.t5}
M = 4


def _seeded(rank: int, world: int, schedule: str, stages_per_rank: int, bucket: int) -> dict[str, Any]:
    sync.BUCKET_BYTES = bucket  # 4 KiB in the interleaved run: the weights go in many messages
    model, _, _, _ = GPT(seed=rank)  # every rank its own weights: a common script bug
    _, inputs, loss_fn, target = GPT(seed=0)
    pipe = pipecut.compile(
        model, inputs, loss_fn=loss_fn, target=target, microbatches=M,
        schedule=schedule, scheduling=pipecut.ScheduleOptions(stages_per_rank=stages_per_rank),
        runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED,
    )
    return {"loss": pipe.step(inputs, target), "grads": pipeline_grads(model, pipe)}


def _names(rank: int, name: str, plan: pipecut.Plan) -> dict[str, Any]:
    model, inputs, loss_fn, target = NAMED[name]()
    pipe = pipecut.compile(
        model, inputs, loss_fn=loss_fn, target=target, plan=plan,
        runtime=pipecut.RuntimeOptions(timeout=60),
    )
    torch.optim.AdamW(pipe.parameters())  # every rank has parameters to train
    return {
        "parameters": [n for n, _ in pipe.named_parameters()],
        "buffers": [n for n, _ in pipe.named_buffers()],
        "state": {k: v.clone() for k, v in pipe.state_dict().items()},
    }


def _counts_calls(rank: int) -> dict[str, Any]:
    model, inputs, loss_fn, target = counts_calls()
    before = snapshot(model, inputs)
    pipe = pipecut.compile(
        model, inputs, loss_fn=loss_fn, target=target, microbatches=M,
        runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED,
    )
    assert_unchanged(before, model, inputs)
    loss = pipe.step(inputs, target)
    return {"loss": loss, "grads": pipeline_grads(model, pipe), "capture": pipe.plan.capture.value,
            "calls": dict(pipe.named_buffers()).get("calls")}


def _batchnorm_untouched(rank: int) -> bool:
    model, inputs, loss_fn, target = resnet.build(batch_size=8)
    before = snapshot(model, inputs)
    pipecut.compile(
        model, inputs, loss_fn=loss_fn, target=target, microbatches=2,
        runtime=pipecut.RuntimeOptions(timeout=60),
    )
    assert_unchanged(before, model, inputs)
    return True


def _refusals(rank: int, plan: pipecut.Plan) -> dict[str, str]:
    out = {}
    model, inputs, loss_fn, target = writes_input()
    before = snapshot(model, inputs)
    with pytest.raises(CaptureError) as writes:
        pipecut.compile(model, inputs, loss_fn=loss_fn, target=target, microbatches=2)
    assert_unchanged(before, model, inputs)
    out["writes_input"] = str(writes.value)
    model, inputs, loss_fn, target = GPT()
    with pytest.raises(PlanError) as conflict:
        pipecut.compile(model, inputs, loss_fn=loss_fn, target=target, plan=plan,
                        microbatches=8, schedule="gpipe")
    out["conflict"] = str(conflict.value)
    return out


def _run(rank: int, world: int, plans: dict[str, pipecut.Plan]) -> dict[str, Any]:
    return {
        "refusals": _refusals(rank, plans["gpt"]),
        "seeded": _seeded(rank, world, "1f1b", 1, sync.BUCKET_BYTES),
        "interleaved": _seeded(rank, world, "interleaved-1f1b", 2, 4096),
        "counts_calls": _counts_calls(rank),
        "batchnorm": _batchnorm_untouched(rank),
        **{f"names_{n}": _names(rank, n, plans[n]) for n in NAMED},
    }


def _plan(build: Any, microbatches: int, schedule: str = "1f1b") -> pipecut.Plan:
    model, inputs, loss_fn, target = build()
    return pipecut.plan(
        model, inputs, devices=2, loss_fn=loss_fn, target=target, microbatches=microbatches,
        schedule=schedule, measure=COUNTED,
    )


@pytest.mark.timeout(400)
def test_model_state_names_and_arguments() -> None:
    # Plans made here (from counted costs: no timing) are replayed by the ranks.
    plans = {"gpt": _plan(GPT, M), **{n: _plan(NAMED[n], 2) for n in NAMED}}
    world = 2
    ranks = run_ranks(_run, world, plans, timeout=380)

    for r in ranks:  # refused the same way on every rank, before any of them waited
        assert "node 'mul_'" in r["refusals"]["writes_input"]
        assert "model input 'x'" in r["refusals"]["writes_input"]
        assert "microbatches=8 (the plan has 4)" in r["refusals"]["conflict"]
        assert "schedule='gpipe' (the plan has '1f1b')" in r["refusals"]["conflict"]
        assert r["batchnorm"]

    # Seeds 0 and 1 on the ranks: both train seed 0's model.
    ref_loss, ref_grads = reference(lambda: GPT(seed=0), M, per_microbatch=False)
    assert_parity(ref_loss, ref_grads, [r["seeded"] for r in ranks])
    assert_parity(ref_loss, ref_grads, [r["interleaved"] for r in ranks])

    # self.calls += 1: captured by torch.export, counted once per microbatch as in the plain
    # model run microbatch by microbatch (the reference), on the ranks holding it.
    ref_loss, ref_grads = reference(counts_calls, M, per_microbatch=True)
    assert_parity(ref_loss, ref_grads, [r["counts_calls"] for r in ranks])
    assert ranks[0]["counts_calls"]["capture"] == "export"
    held = [r["counts_calls"]["calls"] for r in ranks if r["counts_calls"]["calls"] is not None]
    assert held and all(c.item() == M for c in held)

    for name, build in NAMED.items():
        plain, _, _, _ = build()
        per_rank = [r[f"names_{name}"] for r in ranks]
        first_names = dict(plain.named_parameters())
        params = [n for r in per_rank for n in r["parameters"]]
        assert set(params) <= set(first_names), set(params) - set(first_names)
        assert set(params) == set(first_names)
        buffers = [n for r in per_rank for n in r["buffers"]]
        assert set(buffers) <= dict(plain.named_buffers()).keys()
        merged: dict[str, torch.Tensor] = {}
        for r in per_rank:
            assert set(r["state"]) <= plain.state_dict().keys()
            merged.update(r["state"])
        fresh, _, _, _ = build(seed=1)  # other weights: loading must bring seed 0's back
        fresh.load_state_dict(merged, strict=True)
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0, msg=key)
