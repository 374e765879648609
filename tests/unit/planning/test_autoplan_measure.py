"""Measuring for microbatches="auto": one capture serves every size its graph accepts, and the
winner's plan reuses what was measured at its size. Heavy-node pieces are off: whether a
node is heavy enough to chunk depends on measured times, and these tests compare graphs."""

from __future__ import annotations

import torch

import pipecut
from pipecut.capture import capture, fingerprint
from pipecut.core.kinds import CaptureMethod
from pipecut.planning.autoplan import Measurements, accepts
from pipecut.profile.nodes import profile


class Net(torch.nn.Module):
    def __init__(self, branch_on_batch: bool = False) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.branch_on_batch = branch_on_batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.branch_on_batch and x.shape[0] == 4:  # export specialises the batch to 4
            h = h * 2
        return self.b(h)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def _measurements(model: torch.nn.Module, method: CaptureMethod) -> Measurements:
    return Measurements(
        lambda first: capture(model, first, method=method),
        lambda cap, first, target: profile(cap, cap.flatten_inputs(first), loss_fn=_loss, target=target,
                                           repeats=1, warmup=0),
    )


def test_an_export_graph_accepts_sizes_within_its_symbolic_ranges_only() -> None:
    torch.manual_seed(0)
    cap = capture(Net(), (torch.randn(4, 8),), method=CaptureMethod.EXPORT)
    assert accepts(cap, [torch.randn(2, 8)]) and accepts(cap, [torch.randn(16, 8)])
    assert not accepts(cap, [torch.randn(4, 8, dtype=torch.float64)])  # dtype
    assert not accepts(cap, [torch.randn(4, 8, 1)])  # rank
    fixed = capture(Net(branch_on_batch=True), (torch.randn(4, 8),), method=CaptureMethod.EXPORT)
    assert accepts(fixed, [torch.randn(4, 8)]) and not accepts(fixed, [torch.randn(2, 8)])
    traced = capture(Net(), (torch.randn(4, 8),), method=CaptureMethod.SYMBOLIC_TRACE)
    assert accepts(traced, [torch.randn(3, 8)])


def test_one_export_capture_serves_both_sizes_and_the_winner_reuses_it() -> None:
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(8, 8), torch.randn(8, 4)
    m = _measurements(model, CaptureMethod.EXPORT)
    small = m.costs((x[:2],), y[:2])
    large = m.costs((x[:4],), y[:4])
    assert (m.captures, m.profiles) == (1, 2)
    assert [n.name for n in small] == [n.name for n in large]
    assert next(n for n in large if n.name == "linear").shape == (4, 16)  # measured at its own size
    captured, nodes = m.at((x[:2],))
    assert nodes == small and m.captures == 1  # captured at this size: nothing new
    captured, nodes = m.at((x[:4],))  # the graph it was measured on: not captured again
    assert m.captures == 1 and nodes == large
    # ... because it is the graph an export at that size gives, which compile checks.
    assert fingerprint(captured.gm) == fingerprint(capture(model, (x[:4],), method=CaptureMethod.EXPORT).gm)
    captured, nodes = m.at((x[:8],))  # not measured at that size: profiled again, not captured
    assert nodes is None and m.captures == 1
    assert fingerprint(captured.gm) == fingerprint(capture(model, (x[:8],), method=CaptureMethod.EXPORT).gm)
    assert m.at((x[:1],)) is None  # a size the graph does not accept (export specialises 1)


def test_a_graph_specialised_to_one_size_is_captured_again_for_another() -> None:
    torch.manual_seed(0)
    model, x, y = Net(branch_on_batch=True), torch.randn(8, 8), torch.randn(8, 4)
    m = _measurements(model, CaptureMethod.EXPORT)
    m.costs((x[:4],), y[:4])
    m.costs((x[:2],), y[:2])
    assert (m.captures, m.profiles) == (2, 2)
    _, nodes = m.at((x[:2],))
    assert nodes is not None and m.captures == 2


def test_auto_plans_the_graph_a_fixed_plan_at_the_chosen_count_would() -> None:
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(8, 8), torch.randn(8, 4)
    for method in (CaptureMethod.EXPORT, CaptureMethod.SYMBOLIC_TRACE):
        auto = pipecut.plan(
            model, (x,), 2, loss_fn=_loss, target=y, microbatches="auto",
            capture=pipecut.CaptureOptions(method=method),
            measure=pipecut.MeasureOptions(repeats=1, warmup=0),
            partition=pipecut.PartitionOptions(heavy_pieces=False),
        )
        fixed = pipecut.plan(
            model, (x,), 2, loss_fn=_loss, target=y, microbatches=auto.microbatches,
            capture=pipecut.CaptureOptions(method=method),
            measure=pipecut.MeasureOptions(repeats=1, warmup=0),
            partition=pipecut.PartitionOptions(heavy_pieces=False),
        )
        assert auto.fingerprint == fixed.fingerprint and auto.capture is method
        assert [n.name for n in auto.nodes] == [n.name for n in fixed.nodes]
        assert auto.accepts == fixed.accepts


def test_a_winner_between_the_profiled_sizes_is_planned_on_their_graph_without_profiling_again(monkeypatch) -> None:
    import pipecut.planning.autoplan
    import pipecut.planning.request

    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(8, 8), torch.randn(8, 4)
    real_choose, real_profile = pipecut.planning.autoplan.choose_microbatches_and_schedule, pipecut.planning.request.profile
    profiled: list[int] = []

    def middle(*args, **kwargs):  # as if M = 4 (microbatch size 2) won, between 8 and 2
        _, kind, candidates = real_choose(*args, **kwargs)
        return 4, kind, candidates

    def counted(captured, inputs, **kwargs):
        profiled.append(inputs[0].shape[0])
        return real_profile(captured, inputs, **kwargs)

    monkeypatch.setattr(pipecut.planning.autoplan, "choose_microbatches_and_schedule", middle)
    monkeypatch.setattr(pipecut.planning.request, "profile", counted)  # every profile of planning
    auto = pipecut.plan(
        model, (x,), 2, loss_fn=_loss, target=y, microbatches="auto",
        capture=pipecut.CaptureOptions(method=CaptureMethod.EXPORT),
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
        partition=pipecut.PartitionOptions(heavy_pieces=False),
    )
    assert auto.microbatches == 4 and sorted(profiled) == [1, 4]  # the two ends only
    fixed = pipecut.plan(
        model, (x,), 2, loss_fn=_loss, target=y, microbatches=4,
        capture=pipecut.CaptureOptions(method=CaptureMethod.EXPORT),
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
        partition=pipecut.PartitionOptions(heavy_pieces=False),
    )
    assert auto.fingerprint == fixed.fingerprint  # compile's capture at M = 4 will match
    linear = next(n for n in auto.nodes if n.name == "linear")
    assert linear.shape == (2, 16) and "calibrated on whole stages" in auto.solver.detail
