"""Compiling a stage apart from its weight ops (zero-bubble's split backward): the runs that
read no parameter become compiled calls, the ops that read one stay eager, and the split
backward then finds every weight gradient at its own op. The backend here is AOTAutograd
without inductor (inductor is exercised by tests/multiprocess/test_execution_compiled.py, where
its compile time is paid once per fork)."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from pipecut.runtime.execution import compiled
from pipecut.runtime.execution.backward_split import split_backward
from pipecut.runtime.execution.compiled import compile_apart, uncompile_stage, weightless_runs


class Block(nn.Module):
    """A pre-norm MLP block: a norm's scale, two products, the arithmetic between them."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 32) * 0.1)
        self.w2 = nn.Parameter(torch.randn(32, 16) * 0.1)
        self.g = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (16,)) * self.g
        h = h @ self.w1
        h = F.gelu(h) * torch.sigmoid(h) + 1.0
        return (x + h @ self.w2).tanh() * 2


@pytest.fixture
def aot_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """AOTAutograd without inductor: the compiled runs' backwards are AOTAutograd nodes, as
    inductor's are, at a fraction of the compile time (inductor's donated buffers, which a
    retained graph needs turned off, only the multi-process test meets)."""
    from torch._dynamo import lookup_backend

    monkeypatch.setattr(compiled, "inductor_backend", lambda: lookup_backend("aot_eager"))


def test_the_runs_are_the_nodes_between_the_weight_ops() -> None:
    gm = fx.symbolic_trace(Block())
    assert [[n.name for n in run] for run in weightless_runs(gm)] == [["gelu", "sigmoid", "mul_1", "add"],
                                                                      ["add_1", "tanh", "mul_2"]]


class Modules(nn.Module):
    """A module-built MLP, as ``symbolic_trace`` leaves it: its products and norm are calls of
    modules with parameters, its activation and dropout calls of modules without."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.drop = nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.0)
        self.down, self.norm = nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(self.drop(self.act(self.up(x))) * 2))


def test_a_module_without_parameters_joins_a_run_and_a_segment_does_not(aot_backend: None) -> None:
    from pipecut.core.segment import Segment

    torch.manual_seed(0)
    gm = fx.symbolic_trace(Modules())
    assert [[n.name for n in run] for run in weightless_runs(gm)] == [["act", "drop", "mul"]]
    x = torch.randn(4, 16)
    want = gm(x)
    stats, graph = compile_apart(gm, 0)
    torch.testing.assert_close(gm(x), want)
    assert (stats.runs, stats.graphs) == (1, 1)
    uncompile_stage(gm, graph)
    segment = Segment(gm, fx.Graph(), ("act",))  # a recomputed segment holds no parameter, yet runs eagerly
    gm.act = segment
    assert [[n.name for n in run] for run in weightless_runs(gm)] == [["drop", "mul"]]
    gm.act = nn.Sequential(nn.GELU())  # nor does a module with children join (it may hold a segment)
    assert [[n.name for n in run] for run in weightless_runs(gm)] == [["drop", "mul"]]
    gm.act = nn.BatchNorm1d(32, affine=False)  # nor one with buffers it updates as it runs
    assert [[n.name for n in run] for run in weightless_runs(gm)] == [["drop", "mul"]]


def test_a_stage_with_nothing_to_compile_counts_no_run(aot_backend: None) -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)))  # a lone GELU stays eager
    stats, _ = compile_apart(gm, 2)
    gm(torch.randn(2, 4))
    assert (stats.runs, stats.graphs) == (0, 0)


def test_a_stage_compiled_apart_splits_its_backward_at_each_weight(aot_backend: None) -> None:
    torch.manual_seed(0)
    gm = fx.symbolic_trace(Block())
    x = torch.randn(4, 16, requires_grad=True)
    gm(x).square().sum().backward()
    want = {n: p.grad.clone() for n, p in gm.named_parameters()}
    want_x = x.grad.clone()
    gm.zero_grad(set_to_none=True)
    eager_code = gm.code

    stats, graph = compile_apart(gm, 3)
    assert stats.runs == 2
    calls = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "compiled_run"]
    assert len(calls) == 2
    eager = [n.name for n in gm.graph.nodes if n.target in (operator.matmul, operator.mul)]
    assert eager == ["mul", "matmul", "matmul_1"]  # the weight ops (the norm's scale, the products) stay eager
    loss = gm(x).square().sum()
    assert (stats.stage, stats.graphs) == (3, 2)
    (grad_x,), weight_pass = split_backward([loss], [torch.ones(())], [x], list(gm.parameters()))
    assert all(p.grad is None for p in gm.parameters())  # the input pass wrote no weight gradient
    torch.testing.assert_close(grad_x, want_x)
    weight_pass()
    for name, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)

    uncompile_stage(gm, graph)
    assert gm.code == eager_code


class Heads(nn.Module):
    """A stage cut inside attention, as the interleaved Llama's first stage is: it sends a view
    of a projection (heads split and transposed), a slice of that view, a fresh value and a size."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        heads = self.q(x).view(x.shape[0], x.shape[1], -1, 4).transpose(1, 2)
        return x.shape[1], heads, heads[..., :2], torch.relu(x)


def test_a_stage_compiled_whole_returns_its_views_as_fresh_tensors(aot_backend: None) -> None:
    """AOTAutograd would regenerate the view outputs from their base by recorded view ops, which
    its cache stores wrong on torch 2.13 (garbage sizes on a warm hit): the stage returns copies,
    so none is regenerated, and an op's fresh result is not copied."""
    from pipecut.capture import capture
    from pipecut.core.kinds import CaptureMethod

    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    gm = capture(Heads(), (x,), method=CaptureMethod.EXPORT).gm
    want = gm(x)
    eager_code = gm.code
    stats, graph = compiled.compile_program(gm, 1)
    copies = [n for n in gm.graph.nodes if n.target is compiled._fresh]
    assert sorted(n.args[0].target.__name__ for n in copies) == ["slice.Tensor", "transpose.int"]
    got = gm(x)
    assert stats.graphs == 1
    assert got[0] == 8
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w)
    assert all(t._base is None for t in got[1:])  # none regenerated as a view
    assert len({t.untyped_storage().data_ptr() for t in got[1:]}) == 3
    uncompile_stage(gm, graph)
    assert gm.code == eager_code


class Split(nn.Module):
    """Heads cut from a product's output and transposed (a view of the run's input), then a
    product over them; ``ends`` marks a node as a tensor group's region ends are marked."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 16) * 0.1)
        self.w2 = nn.Parameter(torch.randn(4, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = (x @ self.w1).view(2, 8, 4, 4).transpose(1, 2)
        return torch.sigmoid(torch.tanh(heads @ self.w2)).sum()


def test_a_run_compiled_apart_returns_fresh_tensors_and_stops_at_a_marked_node(aot_backend: None) -> None:
    """The runs' view outputs come back as copies (AOTAutograd regenerates an output that views
    its input by ``as_strided``, which a DTensor refuses), and a node marked EAGER (a region end
    of a tensor-parallel stage) ends a run and runs eagerly."""
    from pipecut.core.graph import EAGER

    torch.manual_seed(0)
    gm = fx.symbolic_trace(Split())
    x = torch.randn(2, 8, 16)
    want = gm(x)
    assert [[n.name for n in run] for run in weightless_runs(gm)] == [["view", "transpose"], ["tanh", "sigmoid", "sum_1"]]
    (view,) = [n for n in gm.graph.nodes if n.name == "view"]
    view.meta[EAGER] = True
    assert [[n.name for n in run] for run in weightless_runs(gm)] == [["tanh", "sigmoid", "sum_1"]]  # a lone transpose stays eager
    del view.meta[EAGER]
    seen: list[torch.Tensor] = []

    def recorded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(a)
        return operator.matmul(a, b)

    stats, graph = compile_apart(gm, 0)
    (product,) = [n for n in gm.graph.nodes if n.name == "matmul_1"]  # eager, it reads the first run's output
    product.target = recorded
    gm.recompile()
    torch.testing.assert_close(gm(x), want)
    assert stats.graphs == 2 and seen[0]._base is None  # not regenerated as a view of the product
    uncompile_stage(gm, graph)
