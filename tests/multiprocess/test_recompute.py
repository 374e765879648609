"""Recompute on real ranks, whole stages and single blocks, against the plain model.

Recomputing must not change a number: the loss, every gradient and every buffer equal the plain
model's. BatchNorm is the trap: its forward writes its running statistics, so a forward run
again in backward would write them twice (``num_batches_tracked`` 2x) unless the recompute
sees, and writes into, a copy (``pipecut.runtime.execution.recompute_state``). Two captures are covered:
symbolic_trace (BatchNorm is a module call) and torch.export (a functional batch norm and a
``copy_`` into the buffer, which a segment leaves outside).

Each scenario then takes a step in eval mode with gradients (as when fine-tuning with frozen
BatchNorm statistics): under torch.export that mode has its own graph, whose stages recompute
the same blocks by node name.

Tolerances: fp32, the same kernels on the same microbatches (tests/reference.py). Buffers are
compared against the plain model run microbatch by microbatch, as the pipeline runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import pipecut
from examples import gpt, resnet, zoo
from pipecut.core.batching import split_microbatches
from pipecut.core.graph import canonical_names
from pipecut.core.kinds import Recompute, ScheduleKind
from pipecut.ir import DeviceSpec, Plan
from tests.harness import run_ranks
from tests.reference import (
    ATOL,
    COUNTED,
    RTOL,
    assert_parity,
    pipeline_grads,
    recompute_blocks,
    recompute_whole,
    reference,
)

pytestmark = pytest.mark.dist

M = 4


def _run(build: Any, world: int, how: Any = None, devices: Any = None, base: Plan | None = None,
         schedule: str | None = None) -> dict[str, Any]:
    """One training step and one eval step of ``build``'s model; ``how`` rewrites the plan
    (``base``, or a fresh one; under ``schedule`` where given) before compiling with it."""
    model, inputs, loss_fn, target = build()
    kw: dict[str, Any] = dict(example_inputs=inputs, loss_fn=loss_fn, target=target, microbatches=M,
                              runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED)
    if schedule is not None:
        kw.update(schedule=schedule, scheduling=pipecut.ScheduleOptions(stages_per_rank=2 if schedule == "zbv" else 1))
        base = base and dataclasses.replace(base, schedule=ScheduleKind(schedule))
    plan = None
    if how is not None:
        plan = how(base if base is not None else pipecut.compile(model, devices=world, **kw).plan)
        model, inputs, loss_fn, target = build()
    pipe = pipecut.compile(model, devices=devices or world, plan=plan, **kw)
    calls: dict[str, int] = {}  # forward calls of each module the stages call, in the training step
    hooks = [m.register_forward_hook(lambda *_, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
             for w in pipe.workers.values() for n, m in w.program.module.named_modules()
             if n and not list(m.children()) and type(m).__name__ != "Segment"]
    loss = pipe.step(inputs, target)
    for h in hooks:
        h.remove()
    grads, buffers = pipeline_grads(model, pipe), {n: b.clone() for n, b in pipe.named_buffers()}
    for p in pipe.parameters():
        p.grad = None
    eval_loss = pipe.eval().step(inputs, target)  # eval mode, with gradients (frozen statistics)
    return {
        "loss": loss, "grads": grads, "buffers": buffers,
        "eval": {"loss": eval_loss, "grads": pipeline_grads(model, pipe)},
        "peak": pipe.peak_activation_bytes, "plan": pipe.plan.to_json(), "calls": calls,
        "segments": sum(type(m).__name__ == "Segment" for w in pipe.workers.values()
                        for m in w.program.module.modules()),
    }


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    plain = _run(gpt.build, world)
    # One split for the three GPT runs, so their activation peaks compare like with like (each
    # run's own plan may weigh recompute differently, and the peaks come from different stages).
    split = Plan.from_json(plain["plan"])
    out = {
        "gpt_plain": plain,
        "gpt_blocks": _run(gpt.build, world, lambda p: recompute_blocks(p, "blocks", 1), base=split),
        "gpt_whole": _run(gpt.build, world, recompute_whole, base=split),
        "resnet_whole": _run(resnet.build, world, recompute_whole),
        "resnet_blocks": _run(resnet.build, world, lambda p: recompute_blocks(p, "layers", 2)),
        "zoo_resnet_blocks": _run(zoo.resnet, world, lambda p: recompute_blocks(p, "resnet.encoder.stages", 1)),
        # zero-bubble and ZBV: the input and the weight pass share one recompute
        "gpt_blocks_zb": _run(gpt.build, world, lambda p: recompute_blocks(p, "blocks", 1), base=split, schedule="zero-bubble"),
        "gpt_whole_zbv": _run(gpt.build, world, recompute_whole, schedule="zbv"),
        "resnet_blocks_zb": _run(resnet.build, world, lambda p: recompute_blocks(p, "layers", 2), schedule="zero-bubble"),
    }
    # The planner chooses blocks by itself when a memory limit asks for less than the plain split.
    plain = Plan.from_json(out["gpt_plain"]["plan"])
    cap = int(max(s.peak_memory_bytes for s in plain.stages) * 0.8)  # no split fits without
    out["gpt_capped"] = _run(gpt.build, world, devices=[DeviceSpec(name=f"cpu{r}", memory_bytes=cap) for r in range(world)])
    out["cap"] = cap
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, 2, timeout=400)


def _reference_with_buffers(build: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """The training step's loss and gradients, the buffers after it, and then the loss and
    gradients of a step in eval mode (running statistics, no updates)."""
    loss, grads = reference(build, M, per_microbatch=True)
    model, inputs, loss_fn, target = build()  # buffers after M microbatch forwards, as pipelined
    size = target.shape[0]
    for x, t in zip(split_microbatches(inputs, M, size), split_microbatches(target, M, size)):
        loss_fn(model(**x) if isinstance(x, dict) else model(*x), t)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.eval()
    eval_loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(*inputs), target)
    eval_loss.backward()
    names = canonical_names(model)
    eval_grads = {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}
    return loss, grads, buffers, (eval_loss.detach(), eval_grads)


def _check_buffers(want: dict[str, torch.Tensor], results: list[dict[str, Any]]) -> None:
    seen = set()
    for r in results:
        for name, b in r["buffers"].items():
            if name in want:
                torch.testing.assert_close(b, want[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
                seen.add(name)
    stats = {n for n in want if n.endswith("num_batches_tracked")}
    assert stats and stats <= seen, f"BatchNorm counters on no rank: {sorted(stats - seen)[:3]}"


def test_gpt_recomputes_single_blocks_or_whole_stages_with_plain_gradients(ranks: list[dict[str, Any]]) -> None:
    ref_loss, ref_grads = reference(gpt.build, M, per_microbatch=False)
    for key in ("gpt_blocks", "gpt_whole"):
        assert_parity(ref_loss, ref_grads, [r[key] for r in ranks])
    for r in ranks:
        plan = Plan.from_json(r["gpt_blocks"]["plan"])
        assert all(s.recompute is Recompute.SELECTIVE for s in plan.stages) and r["gpt_blocks"]["segments"] >= 1
        # Memory in finer steps on the same split (the peaks are counted bytes, not timed): one
        # block recomputed keeps less than none, more than all.
        for key in ("gpt_blocks", "gpt_whole"):
            assert [s.nodes for s in Plan.from_json(r[key]["plan"]).stages] == [
                s.nodes for s in Plan.from_json(r["gpt_plain"]["plan"]).stages]
        assert r["gpt_whole"]["peak"] < r["gpt_blocks"]["peak"] < r["gpt_plain"]["peak"]


def test_zero_bubble_and_zbv_recompute_once_for_both_passes(ranks: list[dict[str, Any]]) -> None:
    """Under a split backward a recomputing run's forward runs once more per microbatch, not
    once per autograd call of its input and weight passes (torch's checkpoint would), and the
    gradients are the plain model's."""
    ref_loss, ref_grads = reference(gpt.build, M, per_microbatch=False)
    for key in ("gpt_blocks_zb", "gpt_whole_zbv"):
        assert_parity(ref_loss, ref_grads, [r[key] for r in ranks])
        calls = [c for r in ranks for c in r[key]["calls"].values()]
        assert calls and max(calls) == 2 * M, (key, sorted(set(calls)))  # forward + one recompute
    assert all(set(r["gpt_whole_zbv"]["calls"].values()) == {2 * M} for r in ranks)
    assert {M, 2 * M} == {c for r in ranks for c in r["gpt_blocks_zb"]["calls"].values()}
    for r in ranks:
        assert {s.recompute for s in Plan.from_json(r["gpt_whole_zbv"]["plan"]).stages} == {Recompute.FULL}
        assert Plan.from_json(r["gpt_whole_zbv"]["plan"]).schedule is ScheduleKind.ZBV


@pytest.mark.parametrize("key, build", [("resnet_whole", resnet.build), ("resnet_blocks", resnet.build),
                                        ("zoo_resnet_blocks", zoo.resnet), ("resnet_blocks_zb", resnet.build)])
def test_batchnorm_statistics_are_written_once_per_microbatch_under_recompute(
    ranks: list[dict[str, Any]], key: str, build: Any
) -> None:
    ref_loss, ref_grads, ref_buffers, (eval_loss, eval_grads) = _reference_with_buffers(build)
    assert_parity(ref_loss, ref_grads, [r[key] for r in ranks])
    _check_buffers(ref_buffers, [r[key] for r in ranks])
    assert_parity(eval_loss, eval_grads, [r[key]["eval"] for r in ranks])  # the other mode's graph
    if key.endswith("blocks"):
        assert any(r[key]["segments"] for r in ranks)


def test_a_memory_limit_makes_the_planner_recompute_single_blocks(ranks: list[dict[str, Any]]) -> None:
    ref_loss, ref_grads = reference(gpt.build, M, per_microbatch=False)
    assert_parity(ref_loss, ref_grads, [r["gpt_capped"] for r in ranks])
    plan = Plan.from_json(ranks[0]["gpt_capped"]["plan"])
    kinds = {s.recompute for s in plan.stages}
    assert Recompute.SELECTIVE in kinds, kinds
    assert all(s.peak_memory_bytes <= ranks[0]["cap"] for s in plan.stages)
    for s in plan.stages:
        if s.recompute is Recompute.SELECTIVE:
            assert 0 < len(s.recomputed) < len(s.nodes)
