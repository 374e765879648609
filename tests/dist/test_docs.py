"""The docs' blocks that need several ranks, run as written on forked gloo ranks (tests/docs.py
finds them) and checked against the plain model in this process.

- README.md's first script at 2 ranks: three clipped AdamW steps, every loss the plain model's
  (how it exits under torchrun, with no `destroy_process_group` in it, is tested in
  tests/dist/test_teardown.py).
- docs/training-loop.md's API block at 2 ranks on the GPT example (tied embeddings): the loss
  and, merged over the ranks, the state dict after one AdamW step.
- docs/training-loop.md's whole loop at 4 ranks (automatic microbatches and schedule, bf16
  autocast, clipping, an eval step, a checkpoint, seeded batches of a dataset over two epochs),
  run twice in one folder: the second run resumes from the first one's step-0 checkpoint with
  step 1 and its batch, and repeats the first run's losses and final weights bitwise.
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


def _plain_steps(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Any, *,
                 lr: float, dtype: torch.dtype | None = None,
                 eval_on: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[list[float], list[float]]:
    """Clipped AdamW steps of the plain model, one per batch (under autocast to ``dtype`` if
    given): each step's loss, and the eval loss after each step on ``eval_on`` (default: the
    first batch)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ex, ey = eval_on or batches[0]
    losses, evals = [], []
    for x, y in batches:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        with torch.no_grad():
            evals.append(loss_fn(model.eval()(ex), ey).item())
        model.train()
    return losses, evals


def _plain_readme_losses() -> list[float]:
    """The README script's model, batch and loop in one process without pipecut."""
    scope: dict[str, Any] = {}
    exec(block("README.md", README_MARKER).split("# Rank 0 captures")[0], scope)
    return _plain_steps(scope["model"], [(scope["x"], scope["y"])] * 3, scope["loss_fn"], lr=1e-3)[0]


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


class _Tokens(torch.utils.data.Dataset):
    """20 token sequences (three batches of 8, 8 and 4 per epoch) that note every batch fetched,
    and before each batch after a run's first, the loss the block's previous step left."""

    def __init__(self, scope: dict[str, Any]) -> None:
        torch.manual_seed(1)
        tokens = torch.randint(0, 128, (20, 17))
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]
        self.scope, self.batches, self.losses = scope, [], []  # type: ignore[var-annotated]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.batches:
            self.losses.append(self.scope["loss"].item())
        self.batches.append(list(indices))
        return [self[i] for i in indices]


EPOCHS = 2  # six steps: a checkpoint at step 0 only (step % 500)


def _loop(rank: int, world: int, folder: str) -> list[dict[str, Any]]:
    os.chdir(folder)  # the checkpoints go to ./ckpt
    runs = []
    for _ in range(2):  # the second run finds the first one's checkpoint and resumes from it
        model, (x,), loss_fn, y = _gpt()
        scope: dict[str, Any] = {"model": model, "x": x, "y": y, "loss_fn": loss_fn, "xv": x, "yv": y,
                                 "epochs": EPOCHS}
        data = scope["dataset"] = _Tokens(scope)
        exec(code("docs/training-loop.md", LOOP_MARKER), scope)
        data.losses.append(scope["loss"].item())
        adam_steps = {int(s["step"]) for s in scope["opt"].state.values()}
        runs.append({"losses": data.losses, "batches": data.batches, "start": scope["start"],
                     "val": scope["val"].item() if "val" in scope else None,
                     "logits": scope.get("logits") is not None, "adam_steps": adam_steps,
                     "state": {k: v.detach().clone() for k, v in scope["pipe"].state_dict().items()},
                     "microbatches": scope["pipe"].plan.microbatches})
    return runs


def _plain_loop(batches: list[list[int]]) -> tuple[list[float], float]:
    """bf16-autocast, clipped AdamW steps of the plain model on ``batches`` (rows of the
    dataset): each step's loss, and the eval loss on the example batch after the first."""
    model, (x,), loss_fn, y = _gpt()
    data = _Tokens({})
    steps = [(data.x[rows], data.y[rows]) for rows in batches]
    losses, evals = _plain_steps(model, steps, loss_fn, lr=3e-4, dtype=torch.bfloat16, eval_on=(x, y))
    return losses, evals[0]


@pytest.mark.timeout(600)
def test_training_loop_block_at_four_ranks_matches_plain_model_and_resumes(tmp_path: Path) -> None:
    ranks = run_ranks(_loop, 4, str(tmp_path), timeout=580)
    first = ranks[0][0]
    # Every epoch's order is a permutation of the 20 rows: 8, 8 and 4 of them, none twice.
    assert [len(b) for b in first["batches"]] == [8, 8, 4] * EPOCHS
    for epoch in range(EPOCHS):
        assert sorted(row for rows in first["batches"][3 * epoch:3 * epoch + 3] for row in rows) == list(range(20))
    losses, val = _plain_loop(first["batches"])
    # bf16 autocast: microbatches round in another order than the full batch (see AMP_RTOL in
    # tests/dist/test_amp_shapes.py); the loss moves far less than the gradients (under 1e-5 relative
    # here), and a step moves it by about 1%, so 2e-3 still tells one step from the next.
    for rank_first, rank_resumed in ranks:
        assert rank_first["start"] == 0 and rank_first["adam_steps"] == {6}
        assert rank_first["batches"] == first["batches"]  # the same batch on every rank
        torch.testing.assert_close(rank_first["losses"], losses, rtol=2e-3, atol=0)
        # Resumed from step 0's checkpoint: the next step (1) on the next batch, nothing repeated;
        # the checkpoint's plan replayed, so every loss and weight is bitwise the uninterrupted run's.
        assert rank_resumed["start"] == 1 and rank_resumed["adam_steps"] == {6}
        assert rank_resumed["microbatches"] == rank_first["microbatches"]
        assert rank_resumed["batches"] == first["batches"][1:]
        assert rank_resumed["losses"] == rank_first["losses"][1:]
        torch.testing.assert_close(rank_resumed["state"], rank_first["state"], rtol=0, atol=0)
        torch.testing.assert_close(rank_first["val"], val, rtol=2e-3, atol=0)
        assert rank_resumed["val"] is None  # no step of the resumed run is a multiple of 500
    assert sum(rank[0]["logits"] for rank in ranks) == 1  # the eval step's logits: on the last stage's rank only
    assert (tmp_path / "ckpt").is_dir()
