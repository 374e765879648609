"""Small models with state that forward changes, for the capture-safety and model-state tests.

Each factory returns ``(model, inputs, loss_fn, target)`` like the examples.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CountsCalls(nn.Module):
    """Reassigns a buffer in forward (``self.calls += 1``) and uses it at the end: symbolic_trace
    cannot record the assignment, torch.export can. The update is the first operation and its
    reader the last, so the buffer's value crosses every cut (and is written again by the next
    microbatch while its send may still be in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.fc3(h) * (1 + 0.1 * self.calls)


class CountsInPython(nn.Module):
    """Counts calls in a plain int: no graph can repeat that."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.fc(x)


class WritesInput(nn.Module):
    """Writes into its input after a first layer read it (``view=True``: through a slice)."""

    def __init__(self, view: bool = False) -> None:
        super().__init__()
        self.view = view
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.view:
            x[:, :4].mul_(2)
        else:
            x.mul_(2)
        return self.fc2(x + y)


class WritesInputAfterItem(WritesInput):
    """Reads a value with ``.item()`` first, which fake tensors cannot run: the static check
    must still find the write."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.sum().item()
        x.mul_(2)
        return self.fc2(self.fc1(x)) * s


def _mse(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def counts_calls(batch_size: int = 8, seed: int = 0) -> tuple[nn.Module, Any, Any, torch.Tensor]:
    torch.manual_seed(seed)
    model = CountsCalls()
    return model, (torch.randn(batch_size, 8),), _mse, torch.randn(batch_size, 4)


def writes_input(batch_size: int = 8, seed: int = 0) -> tuple[nn.Module, Any, Any, torch.Tensor]:
    torch.manual_seed(seed)
    model = WritesInput()
    return model, (torch.randn(batch_size, 8),), _mse, torch.randn(batch_size, 4)


def snapshot(model: nn.Module, inputs: Any) -> dict[str, Any]:
    """Everything of the user's that planning or compiling could change, cloned."""
    attrs = {}
    for path, m in model.named_modules():
        for key, value in vars(m).items():
            attrs[f"{path}.{key}"] = value if isinstance(value, (int, float, bool, str)) else id(value)
    flat = inputs.values() if isinstance(inputs, dict) else inputs
    return {
        "tensors": {k: (id(v), v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()},
        "parameters": {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)},
        "buffers": {n: id(b) for n, b in model.named_buffers(remove_duplicate=False)},
        "attrs": attrs,
        "inputs": [t.clone() for t in flat],
        "modes": [m.training for m in model.modules()],
    }


def assert_unchanged(before: dict[str, Any], model: nn.Module, inputs: Any) -> None:
    after = snapshot(model, inputs)
    assert after["parameters"] == before["parameters"]
    assert after["buffers"] == before["buffers"]
    assert after["attrs"] == before["attrs"]
    assert after["modes"] == before["modes"]
    assert before["tensors"].keys() == after["tensors"].keys()
    for name, (ident, value) in before["tensors"].items():
        assert after["tensors"][name][0] == ident, f"{name} was replaced"
        assert torch.equal(after["tensors"][name][1], value), f"{name} changed"
    for a, b in zip(before["inputs"], after["inputs"]):
        assert torch.equal(a, b), "an input tensor changed"
