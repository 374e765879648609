"""``MeasureOptions(estimate=...)``: plans from counted costs, with no clock read.

A plan made from timings moves with the machine's load (two runs of one test split a GPT 73/82
and 81/74 nodes), and with it the order in which gradients are summed. With ``estimate`` every
node's cost is counted on fake tensors and priced on the device's roofline, the link is that
device's interconnect, and nothing is timed: the plan is a function of the model, its inputs and
the options. These tests make every timer fail, so a step that still timed something would raise.
"""

from __future__ import annotations

import dataclasses

import pytest

import pipecut
from examples import gpt, mlp
from pipecut.core.clock import Timer
from pipecut.core.kinds import CostSource
from pipecut.errors import InputError
from pipecut.ir import Plan
from pipecut.profile.devices import device_link

ESTIMATE = pipecut.MeasureOptions(estimate="A100-80GB")


@pytest.fixture
def no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Timer (node profiling, whole stages timed for calibration) raises when made."""

    def refuse(self: Timer) -> None:
        raise AssertionError("a timer was made: estimated planning must not time anything")

    monkeypatch.setattr(Timer, "__post_init__", refuse)


def _same(a: Plan, b: Plan) -> bool:
    """Equal plans but for the solver's own run time (the one clock a plan records)."""
    def untimed(p: Plan) -> Plan:
        return dataclasses.replace(p, solver=dataclasses.replace(p.solver, solve_ms=0.0))

    return untimed(a).to_json() == untimed(b).to_json()


def test_the_profile_name_is_normalised_and_gives_the_link() -> None:
    options = pipecut.MeasureOptions(estimate="a100-80gb")
    assert options.estimate == "A100-80GB" and options.link is None  # asked: no link
    assert options.fixed_link == device_link("A100-80GB") and not options.fixed_link.measured
    given = pipecut.Link(bandwidth_bytes_per_ms=1e6, latency_ms=0.5)
    assert pipecut.MeasureOptions(estimate="H100-SXM", link=given).fixed_link == given  # a link given wins
    assert pipecut.MeasureOptions().fixed_link is None  # timed: the link is measured
    with pytest.raises(InputError, match=r"MeasureOptions\(estimate='A1000'\): no such device profile; "
                                         r"choose one of \[.*'A100-80GB'"):
        pipecut.MeasureOptions(estimate="A1000")


def test_a_fixed_plan_is_estimated_untimed_and_the_same_every_time(no_clock: None) -> None:
    model, inputs, loss_fn, target = gpt.build(batch_size=8, vocab=128, dim=64, heads=4, layers=4, seq=16)
    plans = [pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=8,
                          schedule="gpipe", measure=ESTIMATE) for _ in range(2)]
    assert _same(*plans)
    plan = plans[0]
    assert all(n.source is CostSource.ESTIMATED for n in plan.nodes)
    assert plan.profiled_on == ""  # nothing was measured here
    assert "node costs estimated for A100-80GB" in plan.solver.detail and "not calibrated" in plan.solver.detail
    assert plan.link == ESTIMATE.fixed_link
    again = Plan.from_json(plan.to_json())
    assert again.options is not None and again.options.measure == ESTIMATE


def test_auto_choices_and_heavy_pieces_are_estimated_too(no_clock: None) -> None:
    # Microbatches and schedule left out: chosen on estimated tables. Then, at 1F1B, an LM head
    # heavier than a stage's share: the planner prices the graph with it in row pieces (costed
    # again, on the rewritten graph) against it whole.
    model, inputs, loss_fn, target = gpt.build(batch_size=8, vocab=8192, dim=128, layers=2, seq=64)
    auto = [pipecut.plan(model, inputs, 3, loss_fn=loss_fn, target=target, measure=ESTIMATE) for _ in range(2)]
    assert _same(*auto)
    assert len(auto[0].candidates) > 1
    heavy = [pipecut.plan(model, inputs, 3, loss_fn=loss_fn, target=target, microbatches=4, schedule="1f1b",
                          measure=ESTIMATE) for _ in range(2)]
    assert _same(*heavy)
    assert "heavy node(s) lm_head in 2 row pieces" in heavy[0].solver.detail
    assert all(n.source is CostSource.ESTIMATED for p in (auto[0], heavy[0]) for n in p.nodes)


def test_compiled_stages_cannot_be_priced_without_timing() -> None:
    model, inputs, loss_fn, target = mlp.build(batch_size=8, width=16, depth=3)
    with pytest.raises(InputError, match=r"compile_stages=True.*node costs estimated for A100-80GB"):
        pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2, measure=ESTIMATE,
                     runtime=pipecut.RuntimeOptions(compile_stages=True))
