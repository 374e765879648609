"""Communication on two forked gloo ranks: the 1F1B memory bound holds, actions show up in
torch.profiler traces, and compile refuses a schedule that would hang before anything runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipecut
import pipecut.assemble.choice as choice
from examples import gpt
from pipecut.errors import ScheduleError
from pipecut.passes.costs.stages import inflight_microbatches
from pipecut.schedules.format import parse_schedule
from tests.harness import run_ranks
from tests.reference import COUNTED

pytestmark = pytest.mark.dist

M = 8


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, inputs, loss_fn, target = gpt.build()
    plain = loss_fn(model(*inputs), target).item()
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
        schedule="1f1b", runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED,
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = pipe.step(inputs, target)
    out["loss"], out["plain"] = loss.item(), plain
    out["names"] = sorted({e.key for e in prof.key_averages() if e.key.startswith("pipecut.")})
    out["peak"] = pipe.peak_activation_bytes
    out["peak_sending"] = sum(w.meter.peak_sending for w in pipe.workers.values())
    out["stage"] = pipe.stage
    out["plan"] = pipe.plan.to_json()

    # A schedule that validates rank by rank but hangs across ranks: rank 1 wants microbatch 1
    # first, rank 0 sends microbatch 0 first and then waits for its gradient.
    rest = range(2, M)
    bad = parse_schedule(" ".join(["0F0 0B0 0F1 0B1"] + [f"0F{i} 0B{i}" for i in rest]) + "\n"
                         + " ".join(["1F1 1B1 1F0 1B0"] + [f"1F{i} 1B{i}" for i in rest]))
    original = choice.plan_schedule
    choice.plan_schedule = lambda plan: bad
    try:
        pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
            plan=pipe.plan, runtime=pipecut.RuntimeOptions(timeout=60),
        )
        out["refused"] = None
    except ScheduleError as e:
        out["refused"] = str(e)
    finally:
        choice.plan_schedule = original
    return out


@pytest.mark.timeout(240)
def test_memory_bound_profiler_names_and_refusal() -> None:
    results = run_ranks(_scenarios, 2, timeout=200)
    plan = pipecut.Plan.from_json(results[0]["plan"])
    inflight = inflight_microbatches(plan.schedule, plan.num_stages, M)
    assert inflight == [2, 1]
    for r in results:
        # Microbatch losses are summed in another order than the full batch's mean: float32
        # rounding only (1e-5 relative).
        assert r["loss"] == pytest.approx(r["plain"], rel=1e-5)
        stage = r["stage"]
        assert f"pipecut.{stage}F0" in r["names"] and f"pipecut.{stage}B{M - 1}" in r["names"], r["names"]
        assert "<-- ERROR HERE" in r["refused"] and "rank 1 stops at 1F1" in r["refused"], r["refused"]
        # The plan budgets activation_bytes per microbatch in flight (what autograd saves, as
        # profiling measured it); the meter counts that plus tensors still being sent, which
        # the plan does not count (bounded below).
        bound = plan.stages[stage].activation_bytes * inflight[stage]
        assert 0 < r["peak"] <= bound + r["peak_sending"], (stage, r["peak"], bound, r["peak_sending"])
        # Sent tensors (activations forward, gradients back) live until one receive-wait after
        # their own (gloo reports a send complete only once waited): at most three
        # microbatches' worth here, where holding them to the end of the step would keep M = 8.
        per_mb = plan.stages[stage].send_bytes + plan.stages[stage].recv_bytes
        assert 0 < r["peak_sending"] <= 3 * per_mb, (stage, r["peak_sending"], per_mb)
