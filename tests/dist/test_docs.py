"""The docs' blocks that need several ranks, run as written on forked gloo ranks (tests/docs.py
finds them) and checked against the plain model in this process.

- README.md's first script at 2 ranks: three clipped AdamW steps, every loss the plain model's
  (how it exits under torchrun, with no `destroy_process_group` in it, is tested in
  tests/dist/test_teardown.py).
- docs/training-loop.md's API block at 2 ranks on the GPT example (tied embeddings): the loss
  and, merged over the ranks, the state dict after one AdamW step.
- docs/training-loop.md's whole loop at 4 ranks (automatic microbatches and schedule, bf16
  autocast, clipping, an eval step, a checkpoint), run twice in one folder: the second run
  resumes from the first one's checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from examples import gpt
from tests.docs import block, code
from tests.harness import run_ranks
from tests.reference import ATOL, RTOL

pytestmark = pytest.mark.dist

README_MARKER = "layers = [torch.nn.Sequential"
API_MARKER = "# Planning: one process"
LOOP_MARKER = 'ckpt.latest("ckpt")'


def _gpt() -> Any:
    return gpt.build(batch_size=8, vocab=128, dim=64, heads=4, layers=4, seq=16)


def _two_ranks(rank: int, world: int, folder: str) -> dict[str, Any]:
    os.chdir(folder)  # the blocks write plan.json where they run
    model, (x,), loss_fn, y = _gpt()
    scope = {"model": model, "x": x, "y": y, "loss_fn": loss_fn}
    exec(code("docs/training-loop.md", API_MARKER), scope)
    readme: dict[str, Any] = {}
    exec(code("README.md", README_MARKER), readme)
    return {"readme": readme["losses"], "loss": scope["loss"].detach(),
            "state": {k: v.detach().clone() for k, v in scope["pipe"].state_dict().items()},
            "replay": Path("plan.json").is_file()}


def _plain_steps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, *, lr: float,
                 steps: int, dtype: torch.dtype | None = None) -> tuple[list[float], list[float]]:
    """Clipped AdamW steps of the plain model (under autocast to ``dtype`` if given): each
    step's loss, and the eval loss after each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, evals = [], []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        with torch.no_grad():
            evals.append(loss_fn(model.eval()(x), y).item())
        model.train()
    return losses, evals


def _plain_readme_losses() -> list[float]:
    """The README script's model, batch and loop in one process without pipecut."""
    scope: dict[str, Any] = {}
    exec(block("README.md", README_MARKER).split("# Rank 0 captures")[0], scope)
    return _plain_steps(scope["model"], scope["x"], scope["y"], scope["loss_fn"], lr=1e-3, steps=3)[0]


@pytest.mark.timeout(300)
def test_readme_script_and_api_block_at_two_ranks_match_plain_model(tmp_path: Path) -> None:
    ranks = run_ranks(_two_ranks, 2, str(tmp_path), timeout=280)
    # fp32: summing microbatch gradients reorders additions (see tests/reference.py); three
    # AdamW steps carry those ulps on, still orders of magnitude under RTOL.
    for r in ranks:
        torch.testing.assert_close(r["readme"], _plain_readme_losses(), rtol=RTOL, atol=ATOL)
    model, (x,), loss_fn, y = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        torch.testing.assert_close(r["loss"], loss.detach(), rtol=RTOL, atol=ATOL)
        merged.update(r["state"])
        assert r["replay"]
    assert merged.keys() == model.state_dict().keys()
    torch.testing.assert_close(merged, model.state_dict(), rtol=RTOL, atol=ATOL)


def _loop(rank: int, world: int, folder: str) -> list[dict[str, Any]]:
    os.chdir(folder)  # the checkpoints go to ./ckpt
    runs = []
    for _ in range(2):  # the second run finds the first one's checkpoint and resumes from it
        model, (x,), loss_fn, y = _gpt()
        scope: dict[str, Any] = {"model": model, "x": x, "y": y, "loss_fn": loss_fn, "xv": x, "yv": y}
        losses: list[float] = []

        def loader(scope: dict[str, Any] = scope, losses: list[float] = losses) -> Any:
            for i in range(2):  # the same batch twice; before the second, note the first's loss
                if i:
                    losses.append(scope["loss"].item())
                yield x, y

        scope["loader"] = loader()
        exec(code("docs/training-loop.md", LOOP_MARKER), scope)
        losses.append(scope["loss"].item())
        adam_steps = {int(s["step"]) for s in scope["opt"].state.values()}
        runs.append({"losses": losses, "start": scope["start"], "val": scope["val"].item(),
                     "logits": scope["logits"] is not None, "adam_steps": adam_steps})
    return runs


def _plain_loop() -> tuple[list[float], float]:
    """Two bf16-autocast, clipped AdamW steps of the plain model; the eval loss after the first."""
    model, (x,), loss_fn, y = _gpt()
    losses, evals = _plain_steps(model, x, y, loss_fn, lr=3e-4, steps=2, dtype=torch.bfloat16)
    return losses, evals[0]


@pytest.mark.timeout(600)
def test_training_loop_block_at_four_ranks_matches_plain_model_and_resumes(tmp_path: Path) -> None:
    ranks = run_ranks(_loop, 4, str(tmp_path), timeout=580)
    losses, val = _plain_loop()
    # bf16 autocast: microbatches round in another order than the full batch (see AMP_RTOL in
    # tests/dist/test_amp_shapes.py); the loss moves far less than the gradients (under 1e-5 relative
    # here), and a step moves it by about 1%, so 2e-3 still tells one step from the next.
    for first, resumed in ranks:
        assert first["start"] == 0 and first["adam_steps"] == {2}
        torch.testing.assert_close(first["losses"], losses, rtol=2e-3, atol=0)
        torch.testing.assert_close(first["val"], val, rtol=2e-3, atol=0)
        assert resumed["start"] == 0  # the step the checkpoint recorded
        assert resumed["adam_steps"] == {3}  # AdamW's state came back from the checkpoint
        # Resumed from the weights and AdamW state after step 0: its first step is the first
        # run's second (the same batch), so its loss is that one's.
        torch.testing.assert_close(resumed["losses"][0], first["losses"][1], rtol=2e-3, atol=0)
    for run in range(2):  # the eval step's logits: on the last stage's rank only
        assert sum(rank[run]["logits"] for rank in ranks) == 1
    assert (tmp_path / "ckpt").is_dir()
