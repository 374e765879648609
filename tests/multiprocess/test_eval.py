"""Evaluation and frozen parts on real ranks, against the plain model.

- eval mode: dropout off (symbolic_trace ``F.dropout(x, p, self.training)`` and a transformers
  GPT-2 through torch.export) and BatchNorm running statistics, with loss and outputs equal to
  the plain model in eval mode, bitwise repeatable, no ``.grad`` written, statistics untouched;
- training again after eval, and training a model compiled in eval mode after ``pipe.train()``;
- eval on a derived eval graph at other shapes and under autocast: its cut values are named by
  that graph (fuzz campaign 2026-11-28: ``KeyError: 'sym_size_int_12'`` from the train graph's
  names);
- frozen parts: a ``torch.no_grad()`` block in forward (both capture paths), parameters with
  ``requires_grad=False`` and ``.detach()``; loss and every gradient match, frozen weights keep
  ``.grad`` None;
- refusals: ``requires_grad`` changed after compile; ``model.eval()`` instead of ``pipe.eval()``.

One forked run holds every scenario (forking and compiling are the expensive part); the
references are computed in the parent on fresh models built with the same seed.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipecut
from examples import resnet
from pipecut.core.batching import split_microbatches
from pipecut.core.kinds import CaptureMethod
from pipecut.errors import InputError
from tests.harness import run_ranks
from tests.reference import ATOL, COUNTED, RTOL, assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist


class DropNet(nn.Module):
    """Dropout as a module and as ``F.dropout(..., self.training)``: symbolic_trace bakes the
    latter's flag into the graph, so eval needs the graph traced in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.3)
        self.mid = nn.Linear(64, 64)
        self.mid2 = nn.Linear(64, 64)  # four weighted layers: every one of 4 stages holds one
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.inp(x)))
        h = F.dropout(torch.relu(self.mid(h)), 0.3, self.training)
        return self.out(torch.relu(self.mid2(h)))


def dropnet(batch_size: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    model = DropNet()
    return model, (torch.randn(batch_size, 32),), F.cross_entropy, torch.randint(0, 10, (batch_size,))


class Frozen(nn.Module):
    """A frozen embedding-like first layer, a ``no_grad`` block and a detached skip path."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.first.requires_grad_(False)
        self.a = nn.Linear(64, 64)
        self.frozen = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(torch.tanh(self.first(x))))
        with torch.no_grad():
            f = torch.tanh(self.frozen(h))
        skip = h.detach() * 0.5
        return self.head(torch.tanh(self.b(h + f)) + skip)


def frozen(batch_size: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    model = Frozen()
    return model, (torch.randn(batch_size, 32),), F.cross_entropy, torch.randint(0, 10, (batch_size,))


def gpt2_dropout(batch_size: int = 8, seed: int = 0, p: float = 0.1):
    """transformers GPT-2 with dropout: symbolic_trace fails, torch.export specialises it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=p,
        embd_pdrop=p, attn_pdrop=p, use_cache=False, bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 128, (batch_size, 17))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    return model, {"input_ids": tokens[:, :-1]}, loss_fn, tokens[:, 1:]


def gpt2_short(batch_size: int = 8, seed: int = 0):
    """:func:`gpt2_dropout` with its sequences cut to 8 of their 16 tokens."""
    model, inputs, loss_fn, target = gpt2_dropout(batch_size, seed)
    return model, {"input_ids": inputs["input_ids"][:, :8]}, loss_fn, target[:, :8]


def gpt2_eval_compiled(batch_size: int = 8, seed: int = 0):
    """GPT-2 without dropout probability but with train/eval graphs that differ (export bakes
    the dropout flag): compiled in eval mode, then trained."""
    return gpt2_dropout(batch_size, seed, p=0.0)


M = 4


def _compile(model: Any, world: int, inputs: Any, loss_fn: Any, target: Any, **kw: Any) -> Any:
    return pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
        runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED, **kw,
    )


def _no_grads(pipe: Any) -> bool:
    return all(p.grad is None for p in pipe.parameters())


def _eval_twice(pipe: Any, inputs: Any, target: Any) -> dict[str, Any]:
    with torch.no_grad():
        loss, out = pipe.step(inputs, target, return_outputs=True, all_ranks=True)
    loss2, out2 = pipe.eval_step(inputs, target, return_outputs=True)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    same = loss2 is not None and bool(torch.equal(loss, loss2))
    if out2 is not None:  # the last stage's rank
        same = same and bool(torch.equal(logits, out2 if isinstance(out2, torch.Tensor) else out2.logits))
    return {"loss": loss, "out": logits, "repeatable": same, "no_grads": _no_grads(pipe)}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    res: dict[str, Any] = {}

    # Dropout, symbolic_trace: eval off, bitwise repeatable; outputs without a target.
    model, inputs, loss_fn, target = dropnet()
    pipe = _compile(model, world, inputs, loss_fn, target)
    res["dropnet_capture"] = pipe.plan.capture.value
    res["dropnet_train_nograd"] = _eval_twice(pipe, inputs, target)  # train mode: dropout on
    res["dropnet_eval"] = _eval_twice(pipe.eval(), inputs, target)
    none_loss, outs = pipe.eval_step(inputs, return_outputs=True)
    res["dropnet_outputs_only"] = {"loss": none_loss, "out": outs}
    try:  # with gradients enabled a step needs its loss
        pipe.step(inputs, return_outputs=True)
    except InputError as e:
        res["train_without_loss"] = str(e)
    model.train()  # by hand, not pipe.train(): refused, not silently ignored
    try:
        pipe.step(inputs, target)
    except InputError as e:
        res["dropnet_by_hand"] = str(e)
    model.eval()

    # Dropout, transformers GPT-2 through torch.export; then train again (dropout on again).
    model, inputs, loss_fn, target = gpt2_dropout()
    pipe = _compile(model, world, inputs, loss_fn, target)
    res["gpt2_capture"] = pipe.plan.capture.value
    res["gpt2_eval"] = _eval_twice(pipe.eval(), inputs, target)
    short = gpt2_short()
    res["gpt2_eval_short"] = pipe.eval_step(short[1], short[3], all_ranks=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res["gpt2_eval_autocast"] = pipe.eval_step(inputs, target, all_ranks=True)
    res["gpt2_train_after_eval"] = pipe.train().step(inputs, target)
    res["gpt2_has_grads"] = not _no_grads(pipe)

    # GPT-2 compiled in eval mode, trained after pipe.train() on the derived train graph.
    model, inputs, loss_fn, target = gpt2_eval_compiled()
    model.eval()
    pipe = _compile(model, world, inputs, loss_fn, target)
    res["gpt2_eval_compiled"] = _eval_twice(pipe, inputs, target)
    loss = pipe.train().step(inputs, target)
    res["gpt2_trained"] = {"loss": loss, "grads": pipeline_grads(model, pipe)}

    # BatchNorm: train, eval (running statistics, untouched), train again.
    model, inputs, loss_fn, target = resnet.build(batch_size=8)
    pipe = _compile(model, world, inputs, loss_fn, target)
    first = {"loss": pipe.step(inputs, target), "grads": pipeline_grads(model, pipe)}
    for p in pipe.parameters():
        p.grad = None
    stats = {n: b.clone() for n, b in pipe.named_buffers()}
    res["bn_eval"] = _eval_twice(pipe.eval(), inputs, target)
    res["bn_stats_kept"] = all(torch.equal(b, stats[n]) for n, b in pipe.named_buffers())
    second = {"loss": pipe.train().step(inputs, target), "grads": pipeline_grads(model, pipe)}
    res["bn_train"] = (first, second)

    # Frozen parts on both capture paths.
    for method in (CaptureMethod.SYMBOLIC_TRACE, CaptureMethod.EXPORT):
        model, inputs, loss_fn, target = frozen()
        pipe = _compile(model, world, inputs, loss_fn, target, capture=pipecut.CaptureOptions(method=method))
        loss = pipe.step(inputs, target)
        frozen_grads = [p.grad for n, p in pipe.named_parameters() if n.startswith(("first.", "frozen."))]
        res[f"frozen_{method.value}"] = {
            "loss": loss, "grads": pipeline_grads(model, pipe),
            "frozen_untouched": all(g is None for g in frozen_grads), "capture": pipe.plan.capture.value,
        }

    # Last (it tears the process groups down): requires_grad changed after compile.
    model, inputs, loss_fn, target = frozen()
    model.a.requires_grad_(False)
    model.b.requires_grad_(False)
    pipe = _compile(model, world, inputs, loss_fn, target)
    model.first.requires_grad_(True)
    try:
        pipe.step(inputs, target)
    except Exception as e:
        res["changed_requires_grad"] = f"{type(e).__name__}: {e}"
    return res


def _plain(build: Any, training: bool) -> tuple[torch.Tensor, Any]:
    model, inputs, loss_fn, target = build()
    model.train(training)
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return loss_fn(out, target), out if isinstance(out, torch.Tensor) else out.logits


def _plain_per_microbatch(build: Any, training: bool, model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    fresh, inputs, loss_fn, target = build(batch_size=8)
    model = model if model is not None else fresh
    model.train(training)
    xs, ts = split_microbatches(inputs, M, 8), split_microbatches(target, M, 8)
    with torch.no_grad():
        outs = [model(*x) for x in xs]
    loss = sum(loss_fn(o, t) for o, t in zip(outs, ts)) / M
    return loss, torch.cat(outs)


def _close(a: Any, b: Any, what: str) -> None:
    # Same kernels on the same microbatches, losses summed in another order: ulps (see
    # tests/reference.py for the tolerance).
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(300)
def test_eval_and_frozen_parts_match_plain_model() -> None:
    world = 2
    per_rank = run_ranks(_scenarios, world, timeout=280)
    last = per_rank[-1]

    # Dropout, symbolic_trace.
    assert last["dropnet_capture"] == "symbolic_trace"
    ref_loss, ref_out = _plain(dropnet, training=False)
    for r, res in enumerate(per_rank):
        ev = res["dropnet_eval"]
        assert ev["repeatable"] and ev["no_grads"], r
        _close(ev["loss"], ref_loss, f"rank {r} eval loss")
        _close(ev["out"], ref_out, f"rank {r} eval outputs")
        assert res["dropnet_train_nograd"]["no_grads"]
        # Train mode under no_grad: dropout is on, so the outputs are not the eval ones.
        assert not torch.allclose(res["dropnet_train_nograd"]["out"], ref_out)
    assert last["dropnet_outputs_only"]["loss"] is None
    _close(last["dropnet_outputs_only"]["out"], ref_out, "outputs only")
    assert per_rank[0]["dropnet_outputs_only"]["out"] is None  # not asked for on every rank
    assert "a training step needs the loss" in last["train_without_loss"]
    assert "is in train mode, but the pipeline's eval-mode graph" in last["dropnet_by_hand"]
    assert "pipe.train()/pipe.eval()" in last["dropnet_by_hand"]

    # Dropout, GPT-2 through export.
    assert last["gpt2_capture"] == "export"
    ref_loss, ref_out = _plain(gpt2_dropout, training=False)
    for r, res in enumerate(per_rank):
        assert res["gpt2_eval"]["repeatable"] and res["gpt2_eval"]["no_grads"], r
        _close(res["gpt2_eval"]["loss"], ref_loss, f"rank {r} GPT-2 eval loss")
        _close(res["gpt2_eval"]["out"], ref_out, f"rank {r} GPT-2 eval logits")
        assert res["gpt2_has_grads"]
        assert not torch.allclose(res["gpt2_train_after_eval"], ref_loss)  # dropout on again
    short_loss, _ = _plain(gpt2_short, training=False)
    model, inputs, loss_fn, target = gpt2_dropout()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_loss = loss_fn(model(**inputs), target)
    for r, res in enumerate(per_rank):
        _close(res["gpt2_eval_short"], short_loss, f"rank {r} GPT-2 eval loss, 8 tokens")
        # bf16 products on microbatches and on the whole batch round differently: a few bf16
        # ulps (2**-8 relative) of a loss near 4.9; a missing or doubled term moves it by O(1).
        torch.testing.assert_close(res["gpt2_eval_autocast"], autocast_loss, rtol=2e-2, atol=2e-2,
                                   msg=lambda m, r=r: f"rank {r} GPT-2 eval loss under autocast: {m}")

    # GPT-2 compiled in eval mode, then trained.
    ref_loss, ref_out = _plain(gpt2_eval_compiled, training=False)
    for r, res in enumerate(per_rank):
        _close(res["gpt2_eval_compiled"]["loss"], ref_loss, f"rank {r} eval-compiled loss")
        _close(res["gpt2_eval_compiled"]["out"], ref_out, f"rank {r} eval-compiled logits")
    ref_loss, ref_grads = reference(gpt2_eval_compiled, M, per_microbatch=False)
    assert_parity(ref_loss, ref_grads, [res["gpt2_trained"] for res in per_rank])

    # BatchNorm, GPipe semantics: the reference runs microbatch by microbatch.
    build = lambda: resnet.build(batch_size=8)  # noqa: E731
    ref_loss, ref_grads = reference(build, M, per_microbatch=True)
    assert_parity(ref_loss, ref_grads, [res["bn_train"][0] for res in per_rank])
    assert_parity(ref_loss, ref_grads, [res["bn_train"][1] for res in per_rank])
    ref_model, *_ = resnet.build(batch_size=8)
    _plain_per_microbatch(resnet.build, True, ref_model)  # the train step's statistics updates
    ev_loss, ev_out = _plain_per_microbatch(resnet.build, False, copy.deepcopy(ref_model))
    for r, res in enumerate(per_rank):
        assert res["bn_stats_kept"] and res["bn_eval"]["repeatable"] and res["bn_eval"]["no_grads"], r
        _close(res["bn_eval"]["loss"], ev_loss, f"rank {r} BatchNorm eval loss")
        _close(res["bn_eval"]["out"], ev_out, f"rank {r} BatchNorm eval outputs")

    # Frozen parts, both capture paths.
    ref_loss, ref_grads = reference(frozen, M, per_microbatch=False)
    ref_grads = {n: g for n, g in ref_grads.items() if g is not None}  # the no_grad block's weights
    assert not any(n.startswith(("first.", "frozen.")) for n in ref_grads)
    for method in ("symbolic_trace", "export"):
        results = [res[f"frozen_{method}"] for res in per_rank]
        assert results[0]["capture"] == method
        assert all(r["frozen_untouched"] for r in results)
        assert_parity(ref_loss, ref_grads, results)

    # requires_grad changed after compile: refused on the sender, its peer fails fast.
    assert "requires grad, but the plan was made when it did not" in per_rank[0]["changed_requires_grad"]
    assert "PipelineRuntimeError" in per_rank[1]["changed_requires_grad"]


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    model, inputs, loss_fn, target = dropnet()
    pipe = _compile(model, world, inputs, loss_fn, target, schedule="1f1b")
    res = {"eval": _eval_twice(pipe.eval(), inputs, target)}
    model, inputs, loss_fn, target = frozen()
    pipe = _compile(model, world, inputs, loss_fn, target, schedule="1f1b")
    res["frozen"] = {"loss": pipe.step(inputs, target), "grads": pipeline_grads(model, pipe)}
    return res


@pytest.mark.timeout(200)
def test_eval_and_no_grad_block_on_four_ranks() -> None:
    per_rank = run_ranks(_four_ranks, 4, timeout=180)
    ref_loss, ref_out = _plain(dropnet, training=False)
    for r, res in enumerate(per_rank):
        assert res["eval"]["repeatable"] and res["eval"]["no_grads"], r
        _close(res["eval"]["loss"], ref_loss, f"rank {r} eval loss")
        _close(res["eval"]["out"], ref_out, f"rank {r} eval outputs")
    ref_loss, ref_grads = reference(frozen, M, per_microbatch=False)
    assert_parity(ref_loss, {n: g for n, g in ref_grads.items() if g is not None},
                  [res["frozen"] for res in per_rank])
