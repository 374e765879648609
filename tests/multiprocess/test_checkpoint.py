"""Checkpoints: save per stage under original names, reload with another K or into the plain model,
and resume a killed run with bitwise the losses of an uninterrupted one.

Models: the hand-written GPT (symbolic_trace; its tied embedding is ``tok_emb.weight`` on the
first stage and ``lm_head.weight`` on the last), the zoo ResNet (torch.export; BatchNorm buffers
written in place) and the zoo GPT-2 (torch.export; tied embeddings) for the resume test.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import pipecut
from examples import gpt, zoo
from pipecut.runtime.state import checkpoint as ckpt
from tests.harness import run_ranks
from tests.reference import COUNTED

pytestmark = pytest.mark.dist

MODELS = {
    "gpt": functools.partial(gpt.build, vocab=128, dim=32, heads=2, layers=4, seq=16),
    "resnet": zoo.resnet,
}
M = 4


def _compile(name, world, plan=None):
    model, inputs, loss_fn, target = MODELS[name](batch_size=8, seed=0)
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
        plan=plan, runtime=pipecut.RuntimeOptions(timeout=60),
        measure=COUNTED,  # the K=2 and K=3 splits the same every run: their losses compare alike
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    return pipe, opt, inputs, target


def _train(pipe, opt, inputs, target):
    loss = pipe.step(inputs, target)
    opt.step()
    opt.zero_grad()
    return loss


def _snapshot(pipe, opt):
    """This stage's tensors and optimizer state, by original name, cloned."""
    tensors = ckpt.stage_tensors(pipe)
    names = {id(t): n for n, t in tensors.items()}
    optim = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return {n: t.detach().clone() for n, t in tensors.items()}, optim


def _save_then_train(rank, world, root):
    """K stages: one step, save, two more steps. Returns the snapshot at the save and the losses after."""
    out = {}
    for name in MODELS:
        pipe, opt, inputs, target = _compile(name, world)
        _train(pipe, opt, inputs, target)
        ckpt.save(pipe, ckpt.step_dir(f"{root}/{name}", 1), opt, step=1, extra={"epoch": 7})
        snap = _snapshot(pipe, opt)
        out[name] = (snap, [_train(pipe, opt, inputs, target) for _ in range(2)])
    return out


def _load_then_train(rank, world, root):
    out = {}
    for name in MODELS:
        pipe, opt, inputs, target = _compile(name, world)
        loaded = ckpt.load(pipe, ckpt.latest(f"{root}/{name}"), opt)
        snap = _snapshot(pipe, opt)
        out[name] = (loaded.step, loaded.extra, snap, [_train(pipe, opt, inputs, target) for _ in range(2)])
    return out


def _merge(snapshots):
    tensors, optim = {}, {}
    for t, o in snapshots:
        tensors.update(t)
        optim.update(o)
    return tensors, optim


def test_checkpoint_reshards_across_stage_counts_and_into_plain_model(tmp_path: Path) -> None:
    saved = run_ranks(_save_then_train, 2, str(tmp_path), timeout=240)
    loaded = run_ranks(_load_then_train, 3, str(tmp_path), timeout=240)
    for name, build in MODELS.items():
        want_tensors, want_optim = _merge([r[name][0] for r in saved])
        for rank, result in enumerate(loaded):
            step, extra, (tensors, optim), losses = result[name]
            assert (step, extra) == (1, {"epoch": 7})
            for fqn, t in tensors.items():  # a copy: bitwise equal
                assert torch.equal(t, want_tensors[fqn]), f"{name} rank {rank}: {fqn}"
            for fqn, state in optim.items():
                for key, value in state.items():
                    assert torch.equal(value, want_optim[fqn][key]), f"{name} rank {rank}: {fqn}.{key}"
            # 3 stages instead of 2 sum the tied gradient's parts in another grouping, so the
            # continued losses agree to float32 rounding (1e-6 relative), not bitwise.
            torch.testing.assert_close(losses, saved[0][name][1], rtol=1e-5, atol=1e-6)
        assert set().union(*(r[name][2][1] for r in loaded)) == set(want_optim), "optimizer state lost"

        model = build(batch_size=8, seed=1)[0]  # another seed: every value must come from the file
        info = ckpt.load_into_model(model, ckpt.latest(tmp_path / name))
        assert info.step == 1
        for fqn, t in model.state_dict().items():
            canonical = fqn if fqn in want_tensors else "tok_emb.weight"  # lm_head.weight is tied
            assert torch.equal(t, want_tensors[canonical]), f"{name} plain model: {fqn}"
    with pytest.raises(pipecut.InputError, match=r"lacks \d+ tensor"):
        ckpt.load_into_model(zoo.tagger()[0], ckpt.latest(tmp_path / "gpt"))


def test_load_refuses_incomplete_or_foreign_checkpoints(tmp_path: Path) -> None:
    partial = ckpt.step_dir(tmp_path, 5)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"cut short")
    assert ckpt.latest(tmp_path) is None
    model = MODELS["gpt"](batch_size=8, seed=0)[0]
    with pytest.raises(pipecut.InputError, match="not a complete checkpoint"):
        ckpt.load_into_model(model, partial)


# --- a killed run resumes bitwise -----------------------------------------------------------

STEPS, KILL_AFTER = 6, 3


class Killed(Exception):
    pass


def _run(rank, world, root, kill_after, resume, plan):
    model, inputs, loss_fn, target = zoo.gpt2(batch_size=8, seed=0)
    last = ckpt.latest(root) if resume else None
    # The killed run's survivors notice the dead rank by their receive deadline: keep it short.
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
        plan=plan or (last and last / ckpt.PLAN_FILE),
        runtime=pipecut.RuntimeOptions(timeout=10 if kill_after else 60),
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    start = ckpt.load(pipe, last, opt).step if last else 0
    losses = {}
    for step in range(start + 1, STEPS + 1):
        if kill_after is not None and step == kill_after + 1 and rank == world - 1:
            raise Killed(f"rank {rank} killed before step {step}")  # the others are mid-step
        losses[step] = _train(pipe, opt, inputs, target)
        ckpt.save(pipe, ckpt.step_dir(root, step), opt, step=step)
    return losses, {n: t.detach().clone() for n, t in ckpt.stage_tensors(pipe).items()}


def test_killed_run_resumes_with_bitwise_equal_losses(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with pytest.raises(RuntimeError, match="killed before step 4"):
        run_ranks(_run, 2, str(root), KILL_AFTER, False, None, timeout=240)
    assert ckpt.latest(root) == ckpt.step_dir(root, KILL_AFTER)
    resumed = run_ranks(_run, 2, str(root), None, True, None, timeout=240)
    plan = str(ckpt.step_dir(root, 1) / ckpt.PLAN_FILE)  # the same partition, so the same sums
    straight = run_ranks(_run, 2, str(tmp_path / "straight"), None, False, plan, timeout=240)
    for rank in range(2):
        losses, tensors = resumed[rank]
        want_losses, want_tensors = straight[rank]
        assert sorted(losses) == list(range(KILL_AFTER + 1, STEPS + 1))
        for step, loss in losses.items():
            assert torch.equal(loss, want_losses[step]), f"rank {rank} step {step}: {loss} != {want_losses[step]}"
        for fqn, t in tensors.items():
            assert torch.equal(t, want_tensors[fqn]), f"rank {rank}: {fqn} differs after resuming"
