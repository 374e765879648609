"""Runtime behaviour on real ranks: recompute, timelines, plan replay, bad input, failures."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pipecut
from examples import gpt, mlp
from pipecut.core.kinds import Recompute
from pipecut.errors import InputError, PipelineRuntimeError, PlanError
from pipecut.ir import Plan
from tests.harness import run_ranks
from tests.reference import COUNTED, assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist


def _compile(model: Any, world: int, inputs: Any, loss_fn: Any, target: Any, **kw: Any) -> Any:
    return pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=4,
        runtime=pipecut.RuntimeOptions(timeout=kw.pop("timeout", 60)), measure=COUNTED, **kw,
    )


def _features(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, inputs, loss_fn, target = gpt.build()
    pipe = _compile(model, world, inputs, loss_fn, target)
    pipe.step(inputs, target, record=True)
    out["plain_peak"] = pipe.peak_activation_bytes
    out["trace"] = pipe.trace(f"{tmp}/trace.json")
    if rank == 0:
        pipe.plan.to_json(f"{tmp}/plan.json")
    torch.distributed.barrier()

    # Replaying the saved plan must not profile or plan again.
    import pipecut.assemble.choice

    def no_planning(*a: Any, **k: Any) -> None:
        raise AssertionError("replaying a plan must not plan")

    assert hasattr(pipecut.assemble.choice, "plan_asked")  # the name compile plans through
    pipecut.assemble.choice.plan_asked = no_planning  # type: ignore[assignment]
    saved = Plan.from_json(f"{tmp}/plan.json")
    model, inputs, loss_fn, target = gpt.build()
    pipe = _compile(model, world, inputs, loss_fn, target, plan=f"{tmp}/plan.json")
    out["replayed_same_plan"] = pipe.plan == saved
    # The plan carries compile's options: replayed without runtime=, it runs with its timeout.
    carried = pipecut.compile(model, inputs, world, loss_fn=loss_fn, target=target,
                              plan=f"{tmp}/plan.json")
    out["carried"] = (saved.options.runtime.timeout, carried.plan.options.runtime.timeout,
                      {p.timeout.total_seconds() for w in carried.workers.values() for p in (w.prev, w.next) if p})

    # Recompute everywhere: same gradients, less activation memory kept.
    recompute = dataclasses.replace(
        saved, stages=tuple(dataclasses.replace(s, recompute=Recompute.FULL) for s in saved.stages)
    )
    model, inputs, loss_fn, target = gpt.build()
    pipe = _compile(model, world, inputs, loss_fn, target, plan=recompute)
    loss = pipe.step(inputs, target)
    out["recompute"] = {"loss": loss, "grads": pipeline_grads(model, pipe)}
    out["recompute_peak"] = pipe.peak_activation_bytes

    # Bad input fails identically on every rank, before any communication. (Shorter sequences
    # and smaller batches run: tests/multiprocess/test_amp_shapes.py.)
    for name, call in {
        "shape": lambda: pipe.step((inputs[0].repeat(1, 2),), target.repeat(1, 2)),
        "batch": lambda: pipe.step((inputs[0].repeat(2, 1),), target.repeat(2, 1)),
        "type": lambda: pipe.step(inputs[0], target),
    }.items():
        try:
            call()
            out[name] = "no error"
        except InputError as e:
            out[name] = str(e)
    try:
        _compile(*mlp.build()[:1], world, *mlp.build()[1:], plan=f"{tmp}/plan.json")
        out["other_model"] = "no error"
    except PlanError as e:
        out["other_model"] = str(e)
    try:
        _compile(*gpt.build()[:1], world + 1, *gpt.build()[1:])
        out["devices"] = "no error"
    except InputError as e:
        out["devices"] = str(e)
    return out


@pytest.mark.timeout(300)
def test_recompute_trace_replay_and_bad_input(tmp_path: Path) -> None:
    world = 2
    results = run_ranks(_features, world, str(tmp_path), timeout=280)
    ref_loss, ref_grads = reference(gpt.build, 4, per_microbatch=False)
    assert_parity(ref_loss, ref_grads, [r["recompute"] for r in results])
    for r in results:
        assert r["replayed_same_plan"]
        assert r["carried"] == (60, 60, {60.0})
        assert 0 < r["recompute_peak"] < r["plain_peak"]
        assert "microbatch shape (4, 128)" in r["shape"] and "idx: int64 [1..4, 1..64]" in r["shape"]
        assert "32 samples, more than the planned 16" in r["batch"]
        assert "tuple of positional tensors" in r["type"]
        assert "made for another model" in r["other_model"]
        assert "3 devices (stages) asked for" in r["devices"] and "has 2 ranks" in r["devices"]
    trace = results[0]["trace"]
    assert json.loads((tmp_path / "trace.json").read_text()) == trace
    measured = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] < 1000]
    predicted = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] >= 1000]
    assert len(measured) == len(predicted) == world * 2 * 4
    assert {e["name"] for e in measured} == {e["name"] for e in predicted}


def _fault(rank: int, world: int, where: str, bad_rank: int) -> dict[str, Any]:
    model, inputs, loss_fn, target = mlp.build()
    pipe = _compile(model, world, inputs, loss_fn, target, timeout=float(os.environ.get("PIPECUT_TEST_TIMEOUT", 4)))
    pipe.step(inputs, target)  # a healthy step first
    if rank == bad_rank:
        worker = pipe.workers[pipe.stage]
        if where in ("forward", "backward", "hang", "kill"):
            original = getattr(worker, "backward" if where == "backward" else "forward")

            def faulty(mb: int, *args: Any) -> Any:
                if mb == 2:
                    if where == "kill":
                        os._exit(3)
                    if where == "hang":
                        time.sleep(12)
                    else:
                        raise RuntimeError(f"injected fault in {where}")
                return original(mb, *args)

            setattr(worker, "backward" if where == "backward" else "forward", faulty)
        elif where == "send":
            peer = worker.next or worker.prev
            original_send = peer.send_op

            def faulty_send(tensor: Any, transfer: Any) -> Any:
                if transfer.microbatch == 1:
                    raise ConnectionError("injected fault during a send")
                return original_send(tensor, transfer)

            peer.send_op = faulty_send
    start = time.perf_counter()
    try:
        pipe.step(inputs, target)
        return {"error": None, "seconds": time.perf_counter() - start}
    except (PipelineRuntimeError, RuntimeError, ConnectionError) as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - start}


def _run_fault(where: str, bad_rank: int, world: int = 3) -> list[Any]:
    return run_ranks(_fault, world, where, bad_rank, timeout=60, allow_missing=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["forward", "backward", "send"])
def test_a_failing_rank_stops_every_rank_fast_and_is_named(where: str) -> None:
    bad = 1
    results = _run_fault(where, bad)
    assert "injected fault" in results[bad]["error"]
    for r, res in enumerate(results):
        if r == bad:
            continue
        assert res["error"] is not None
        assert res["seconds"] < 3, res  # torn down, not timed out (the timeout is 4 s)
        assert f"rank {bad}" in res["error"], res["error"]


@pytest.mark.timeout(120)
def test_a_killed_rank_is_named_by_its_neighbours_at_once() -> None:
    results = _run_fault("kill", 1)
    assert results[1] is None  # killed: no result
    for r in (0, 2):
        assert results[r]["seconds"] < 3, results[r]
        assert "rank 1" in results[r]["error"], results[r]["error"]


@pytest.mark.timeout(120)
def test_a_hung_rank_is_caught_by_the_deadline() -> None:
    results = _run_fault("hang", 1)  # rank 1 sleeps 12 s; receives time out after 4 s
    for r in (0, 2):
        assert results[r]["error"] is not None
        assert 3.5 < results[r]["seconds"] < 10, results[r]
        assert "rank 1" in results[r]["error"], results[r]["error"]
