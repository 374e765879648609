"""held_checkpoint: one recompute for every autograd call of a split backward, plain gradients."""

from __future__ import annotations

import pytest
import torch

from pipecut.errors import PipelineRuntimeError
from pipecut.runtime.execution.backward_split import split_backward
from pipecut.runtime.execution.held_recompute import held_checkpoint


class Block(torch.nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.drop = torch.nn.Dropout(dropout)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


def _grads(block: Block) -> list[torch.Tensor]:
    return [p.grad.clone() for p in block.parameters()]


def test_a_split_backward_recomputes_once_and_gets_the_plain_gradients() -> None:
    """torch's checkpoint would run the block again for the input pass and again for each of
    the weight pass's autograd calls; held, the block runs twice in all (forward, recompute)."""
    x = torch.randn(4, 8)
    plain = Block(dropout=0.3)
    torch.manual_seed(1)
    plain_x = x.clone().requires_grad_()
    plain(plain_x).square().sum().backward()

    held = Block(dropout=0.3)
    torch.manual_seed(1)  # the same dropout mask in the forward; the recompute replays it
    inp = x.clone().requires_grad_()
    out = held_checkpoint(held, inp).square().sum()
    assert held.calls == 1
    (dx,), weight_pass = split_backward([out], [torch.ones(())], [inp], list(held.parameters()))
    assert held.calls == 2  # recomputed in the input pass
    weight_pass()
    assert held.calls == 2  # and not again in the weight pass's calls
    torch.testing.assert_close(dx, plain_x.grad)
    for got, want in zip(_grads(held), _grads(plain)):
        torch.testing.assert_close(got, want)


def test_a_first_stage_recomputes_in_the_weight_pass_under_autocast() -> None:
    """No input requires grad (a first stage): the weight pass is the first to unpack, and the
    recompute runs under the forward's autocast."""
    x = torch.randn(4, 8)
    plain = Block()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x).float().square().sum().backward()
    held = Block()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = held_checkpoint(held, x).float().square().sum()
    _, weight_pass = split_backward([out], [torch.ones(())], [], list(held.parameters()))
    assert held.calls == 1
    weight_pass()  # outside autocast, as the schedule runs it later
    assert held.calls == 2
    for got, want in zip(_grads(held), _grads(plain)):
        torch.testing.assert_close(got, want)


def test_a_recompute_that_saves_other_tensors_is_refused_in_words() -> None:
    flips = iter([True, False])

    def changing(x: torch.Tensor) -> torch.Tensor:
        return x.exp().exp() if next(flips) else x.exp()

    x = torch.randn(3, requires_grad=True)
    out = held_checkpoint(changing, x).sum()
    with pytest.raises(PipelineRuntimeError, match="does not compute the same thing twice"):
        out.backward()
