"""A node too big to run where the profiler runs is estimated from its work, not measured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipecut
from pipecut.capture import capture
from pipecut.core.kinds import CostSource, NodeOp
from pipecut.ir import NodeCost
from pipecut.profile.flops import NodeWork
from pipecut.profile.nodes import profile
from pipecut.profile.oversized import estimate_oversized, is_out_of_memory


class TooBig(nn.Linear):
    """Stands for a layer the profiling device cannot hold: any real run runs out of memory."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return super().forward(x)


class Broken(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


def _model(middle: type[nn.Linear]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), middle(256, 256),
                         nn.GELU(), nn.Linear(256, 10))


def test_the_oversized_node_is_estimated_the_others_measured_and_planning_goes_on() -> None:
    model = _model(TooBig)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    cap = capture(model, (x[:16],), leaf_modules=(TooBig,))
    rows = {r.name: r for r in profile(cap, cap.flatten_inputs((x[:16],)), loss_fn=nn.functional.cross_entropy,
                                       target=y[:16], repeats=3, warmup=1, reuse=False)}
    big = rows["_4"]  # the TooBig layer
    twin = rows["_2"]  # the same Linear(256, 256), measured
    assert big.source is CostSource.ESTIMATED
    assert all(r.source is CostSource.MEASURED for n, r in rows.items() if n != big.name)
    assert big.output_bytes == twin.output_bytes and big.param_bytes == twin.param_bytes
    # Priced at the rate the measured products ran at: the same FLOPs as its twin.
    assert 0.2 * twin.forward_ms < big.forward_ms < 5 * twin.forward_ms
    assert 0.2 * twin.backward_ms < big.backward_ms < 5 * twin.backward_ms
    plan = pipecut.plan(
        model, (x,), 2, loss_fn=nn.functional.cross_entropy, target=y, microbatches=4,
        capture=pipecut.CaptureOptions(leaf_modules=(TooBig,)),
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
    )
    assert plan.node(big.name).source is CostSource.ESTIMATED
    assert "too big to run on cpu estimated from their work (_4)" in plan.solver.detail
    assert sum(len(s.nodes) for s in plan.stages) > 0


def test_other_errors_are_not_swallowed() -> None:
    model = _model(Broken)
    x = torch.randn(16, 256)
    cap = capture(model, (x,), leaf_modules=(Broken,))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        profile(cap, cap.flatten_inputs((x,)), repeats=1, warmup=0)


@pytest.mark.parametrize(("error", "expected"), [
    (torch.OutOfMemoryError("CUDA out of memory"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 68719476736 bytes"), True),
    (MemoryError(), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("out of memory"), False),
])
def test_out_of_memory_is_told_apart(error: BaseException, expected: bool) -> None:
    assert is_out_of_memory(error) is expected


def _row(name: str, fwd: float, bwd: float) -> NodeCost:
    return NodeCost(name=name, op=NodeOp.CALL_FUNCTION, target="t", module="", inputs=(), forward_ms=fwd,
                    backward_ms=bwd, output_bytes=4, param_bytes=0)


def test_rates_come_from_the_measured_nodes_by_flops_or_bytes() -> None:
    rows = [_row("mm", 2.0, 4.0), _row("add", 1.0, 0.0), _row("big_mm", 0, 0), _row("big_add", 0, 0)]
    measured = {"mm": NodeWork(forward_flops=1000, backward_flops=2000, forward_bytes=10, backward_bytes=20),
                "add": NodeWork(forward_bytes=100)}
    oversized = {"big_mm": NodeWork(forward_flops=5000, backward_flops=10000, forward_bytes=50, backward_bytes=100),
                 "big_add": NodeWork(forward_bytes=300, backward_bytes=0)}
    out = {r.name: r for r in estimate_oversized(rows, measured, oversized)}
    assert out["big_mm"].forward_ms == pytest.approx(10.0) and out["big_mm"].backward_ms == pytest.approx(20.0)
    assert out["big_add"].forward_ms == pytest.approx(3.0) and out["big_add"].backward_ms == 0.0
    assert out["mm"] == rows[0] and out["big_mm"].source is CostSource.ESTIMATED
