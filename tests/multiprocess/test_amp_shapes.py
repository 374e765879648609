"""Autocast and variable shapes at 2 ranks: the pipeline matches the plain model, or refuses.

One fork runs every scenario: plans are made once in the parent from counted costs (tests/reference.py:
COUNTED: the same split every run, whatever the machine's load) and replayed on the ranks, and one
pipeline per (model, schedule) runs several steps of different shapes and autocast states.
The reference for each step is the unsplit model in the parent under the same autocast state,
on the same (possibly smaller, shorter) batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

import pipecut
from examples import gpt, mlp, zoo
from pipecut.core.kinds import ScheduleKind
from pipecut.errors import InputError
from tests.harness import run_ranks
from tests.multiprocess.test_parity import hf_gpt2
from tests.reference import COUNTED, assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist

Build = Callable[[], tuple[torch.nn.Module, Any, Any, Any]]


def _mlp() -> Any:
    return mlp.build(batch_size=16, width=64, depth=4)


def _gpt() -> Any:
    return gpt.build(batch_size=8, vocab=128, dim=64, heads=4, layers=2, seq=16)


MODELS: dict[str, tuple[Build, int]] = {
    "mlp": (_mlp, 4), "gpt": (_gpt, 4), "hf_gpt2": (hf_gpt2, 4), "tagger": (zoo.tagger, 4),
}
"""name -> (factory, planned microbatches)."""
PER_MICROBATCH = {"tagger"}
"""BatchNorm: the reference runs microbatch by microbatch (GPipe semantics), equal ones only."""


def _cut(batch: Any, rows: int, seq: int | None) -> Any:
    """The first ``rows`` samples (and ``seq`` positions) of every tensor in a batch."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        t = t[:rows]
        return t[:, :seq] if seq is not None and t.dim() > 1 else t

    if isinstance(batch, dict):
        return {k: cut(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(cut(v) for v in batch)
    return cut(batch)


@dataclasses.dataclass(frozen=True)
class Step:
    """One pipe.step: which rows and sequence prefix of the example batch, under which autocast."""

    rows: int | None = None
    seq: int | None = None
    amp: str | None = None  # "bfloat16" / "float16"


# (model, schedule, steps run on one pipeline)
SCENARIOS: list[tuple[str, str, tuple[Step, ...]]] = [
    ("mlp", "gpipe", (Step(amp="bfloat16"), Step(amp="float16"), Step(rows=10), Step(rows=3))),
    ("gpt", "1f1b", (Step(amp="bfloat16"), Step(seq=11), Step(rows=6, seq=9), Step(rows=5, amp="bfloat16"))),
    ("gpt", "zero-bubble", (Step(amp="bfloat16"), Step(rows=7, seq=12))),
    ("hf_gpt2", "gpipe", (Step(seq=10), Step(rows=6, seq=7), Step(amp="bfloat16"))),
    # symbolic_trace with a torch.Size and ints (batch, seq) crossing every cut: they follow the
    # shorter sequence through the same propagation.
    ("tagger", "1f1b", (Step(seq=11), Step(seq=5, amp="bfloat16"))),
]


def _amp(dtype: str | None) -> Any:
    return torch.autocast("cpu", dtype=getattr(torch, dtype)) if dtype else torch.autocast("cpu", enabled=False)


def _ranks(rank: int, world: int, plans: dict[tuple[str, str], str]) -> list[Any]:
    results: list[Any] = []
    for name, schedule, steps in SCENARIOS:
        build, m = MODELS[name]
        model, inputs, loss_fn, target = build()
        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target, microbatches=m,
            plan=plans[name, schedule], runtime=pipecut.RuntimeOptions(timeout=60),
        )
        for step in steps:
            x = _cut(inputs, step.rows or 10**9, step.seq)
            y = _cut(target, step.rows or 10**9, step.seq)
            for p in pipe.parameters():
                p.grad = None
            with _amp(step.amp):
                loss = pipe.step(x, y)
            results.append({"loss": loss, "grads": pipeline_grads(model, pipe)})
        if name == "gpt":  # refusals, raised on every rank before anything is sent
            errors = []
            for bad in ((_cut(inputs, 8, None)[0][:, :0],), (torch.cat([inputs[0], inputs[0]], 1),),
                        (torch.cat([inputs[0], inputs[0]]),), (inputs[0].int(),)):
                try:
                    pipe.step(bad, target)
                    errors.append("no error")
                except InputError as e:
                    errors.append(str(e))
            results.append(errors)
    return results


# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 2e-3 per op); fp16 keeps 11. The
# pipeline runs the same autocast kernels on microbatches while the reference runs the whole
# batch, so matmul reductions and the sum of per-microbatch weight gradients are rounded in a
# different order. Measured over these scenarios: at most 3e-3 (bf16) and 2e-4 (fp16) of the
# largest gradient entry, so the tolerances leave 3x and 10x; the absolute part (relative to
# the gradients' scale) covers entries near zero. A wrong dtype on the wire (bf16 bytes read as
# fp32 gave losses of 1e8) or a lost or doubled microbatch (O(1)) is far outside them.
AMP_RTOL = {"bfloat16": 1e-2, "float16": 2e-3}


def _plain_reference(name: str, step: Step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    build, m = MODELS[name]

    def cut_build() -> Any:
        model, inputs, loss_fn, target = build()
        return model, _cut(inputs, step.rows or 10**9, step.seq), loss_fn, _cut(target, step.rows or 10**9, step.seq)

    with _amp(step.amp):
        return reference(cut_build, m, per_microbatch=name in PER_MICROBATCH)


@pytest.mark.timeout(300)
def test_autocast_and_variable_shapes_match_plain_model() -> None:
    plans: dict[tuple[str, str], str] = {}
    for name, schedule, _ in SCENARIOS:
        build, m = MODELS[name]
        if (name, schedule) not in plans:
            model, inputs, loss_fn, target = build()
            plans[name, schedule] = pipecut.plan(
                model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=m,
                schedule=ScheduleKind(schedule),
                measure=COUNTED,
            ).to_json()
    # torch.export kept batch and sequence symbolic (from its lower bound of 2), as one symbol each.
    accepts = pipecut.Plan.from_json(plans["hf_gpt2", "gpipe"]).accepts
    assert [(s.name, s.min_shape, s.max_shape) for s in accepts] == [("input_ids", (2, 2), (2, 16))]
    assert all(accepts[0].symbols) and len(set(accepts[0].symbols)) == 2
    per_rank = run_ranks(_ranks, 2, plans, timeout=280)
    i = 0
    for name, _, steps in SCENARIOS:
        for step in steps:
            ref_loss, ref_grads = _plain_reference(name, step)
            results = [rank[i] for rank in per_rank]
            if step.amp:
                rtol = AMP_RTOL[step.amp]
                scale = max(g.abs().max().item() for g in ref_grads.values())
                assert_parity(ref_loss, ref_grads, results, rtol=rtol, atol=rtol * scale)
            else:
                assert_parity(ref_loss, ref_grads, results)
            i += 1
        if name == "gpt":
            errors = per_rank[0][i]
            assert errors[0].startswith("input 'idx' has microbatch shape (2, 0)"), errors[0]
            assert "microbatch shape (2, 32)" in errors[1] and "idx: int64 [1..2, 1..16]" in errors[1]
            assert "re-plan" in errors[1]
            assert "16 samples, more than the planned 8" in errors[2]
            assert "dtype int32, the plan has int64" in errors[3]
            i += 1
