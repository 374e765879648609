"""Bugs the differential fuzzer found, one test each, with the shrunk configuration and what was
seen (benchmarks/fuzz.py; reproduce one with ``benchmarks/fuzz.py --replay "Config(...)"``).

Each configuration has one expected outcome, asserted exactly: it matches the plain model, or
it is refused with a given PipecutError class and message (:func:`expect`). A fix that turns a
match into a refusal fails here, and so does a refusal that starts running.

A bug still open is a strict xfail (with an entry in ``KNOWN`` of tests/fuzz_bugs.py that
keeps the fixed budget of tests/multiprocess/test_fuzz.py off it); when its fix lands, XPASS fails the
run and both go.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.fuzz_config import Config
from tests.fuzz_pool import Outcome, run_configs

pytestmark = pytest.mark.dist


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Expected:
    """What a configuration must do: ``match``, or ``refused`` with ``error`` (a PipecutError
    class name) and a message matching ``message`` (a regular expression)."""

    kind: str
    error: str = ""
    message: str = ""


MATCH = Expected(kind="match")


def refused(error: str, message: str) -> Expected:
    return Expected(kind="refused", error=error, message=message)


def expect(outcome: Outcome, expected: Expected) -> None:
    """Assert that ``outcome`` is exactly ``expected``."""
    assert outcome.kind == expected.kind, (
        f"expected {expected.kind}{' ' + expected.error if expected.error else ''}, got {outcome.kind} "
        f"{outcome.error} at {outcome.at}: {outcome.detail[-3000:]}")
    if expected.kind == "refused":
        assert outcome.error == expected.error, f"refused with {outcome.error}, not {expected.error}: {outcome.detail}"
        assert re.search(expected.message, outcome.detail), f"{expected.message!r} not in {outcome.detail!r}"


TIED_ACCUMULATION = Config(model="tied_lm", ranks=3, microbatches=1, schedule="zero-bubble",
                           split=("blocks.0", "blocks.3.mlp"), reduction="sum", accumulation=3,
                           last="fewer_rows", eval_between=True)
TIED_NO_SYNC = Config(model="tied_lm", ranks=2, microbatches=2, schedule="1f1b", split=("blocks.2",),
                      accumulation=3, no_sync=True)
FSDP_CLIP = Config(model="moe", ranks=2, microbatches=1, schedule="gpipe", split=("pre",),
                   data_parallel="fsdp", clip=0.05)
DDP_FROZEN_STAGE = Config(model="frozen", ranks=2, microbatches=1, schedule="gpipe", split=("layers.0",),
                          data_parallel="ddp", clip=None)
FSDP_AUTOCAST_1F1B = Config(model="skip", ranks=2, microbatches=2, schedule="1f1b", split=("layers.3",),
                            autocast="bf16", data_parallel="fsdp", clip=None)
FSDP_AUTOCAST_GPIPE = Config(model="skip", ranks=2, microbatches=2, schedule="gpipe", split=("layers.3",),
                             autocast="bf16", data_parallel="fsdp", clip=None)
INTERLEAVED_ODD = Config(model="skip", ranks=2, microbatches=3, schedule="interleaved-1f1b", split=("layers.3",),
                         last="fewer_rows")
INTERLEAVED_ODD_SEVERAL = Config(model="skip", ranks=2, microbatches=3, schedule="interleaved-1f1b", stages_per_rank=2,
                                 split=("layers.1", "layers.3", "layers.5"))
# Compile chooses (microbatches="auto"), on a pinned split so that measured times cannot move it.
AUTO_SCHEDULE_DDP = Config(model="skip", ranks=2, microbatches=4, schedule="1f1b", plan="split", split=("layers.3",),
                           choose="both", data_parallel="ddp")
AUTO_COUNT_INTERLEAVED = Config(model="tied_lm", ranks=2, microbatches=3, schedule="interleaved-1f1b", plan="split",
                                split=("blocks.2",), choose="microbatches", accumulation=2, no_sync=True,
                                last="shorter_seq", eval_between=True, data_parallel="fsdp", rows=3)
FSDP_EVAL_STALE = Config(model="bert", ranks=2, microbatches=1, schedule="gpipe", split=("bert.encoder.layer.1",),
                         eval_between=True, data_parallel="fsdp", clip=None)
FLOAT64_LOSS = Config(model="skip", ranks=2, microbatches=1, schedule="gpipe", split=("layers.3",), clip=None,
                      dtype="float64", default_dtype="float64")
DDP_FREEZE = Config(model="skip", ranks=2, microbatches=2, schedule="gpipe", split=("layers.3",), data_parallel="ddp",
                    steps=3, clip=None, freeze="layers.0.0.bias")
CASES = (FSDP_EVAL_STALE, FLOAT64_LOSS, DDP_FREEZE, AUTO_COUNT_INTERLEAVED, AUTO_SCHEDULE_DDP, INTERLEAVED_ODD, INTERLEAVED_ODD_SEVERAL, TIED_ACCUMULATION,
         TIED_NO_SYNC, FSDP_CLIP, DDP_FROZEN_STAGE, FSDP_AUTOCAST_1F1B, FSDP_AUTOCAST_GPIPE)


@pytest.fixture(scope="module")
def outcomes() -> dict[Config, Outcome]:
    return {o.config: o for o in run_configs(CASES, job_timeout=120)}


@pytest.mark.timeout(300)
def test_accumulating_a_tied_weight_counts_each_step_once(outcomes: dict[Config, Outcome]) -> None:
    """Fixed on main (8c698d9: the tied gradient of earlier steps is set aside before summing).
    Before, two ``pipe.step`` calls before ``opt.step()`` all-reduced the tied weight's whole
    ``.grad`` each time, counting earlier steps once per stage:

        step 0: rank 0 grad tok_emb.weight: Tensor-likes are not close!
        Mismatched elements: 2048 / 2048 (100.0%)
        Greatest absolute difference: 1.209555983543396 at index (3, 2) (up to 4.7e-06 allowed)
    """
    expect(outcomes[TIED_ACCUMULATION], MATCH)
    expect(outcomes[TIED_NO_SYNC], MATCH)


@pytest.mark.timeout(300)
def test_fsdp_clip_grad_norm(outcomes: dict[Config, Outcome]) -> None:
    """Fixed on main (802ce3b: the norm of each FSDP gradient is reduced over its shards).
    ``pipe.clip_grad_norm_`` after a step with ``data_parallel="fsdp"`` (any schedule; also
    interleaved), 2 x 2 ranks:

        File "runtime/pipeline.py", line 454, in clip_grad_norm_
        File "runtime/grads/collective.py", line 233, in clip_grad_norm_
        File "runtime/grads/collective.py", line 197, in total_grad_norm
            exchange[index] = torch.stack([x.to(device, torch.float64) for x in norms])
        RuntimeError: aten.index_put_.default got mixed torch.Tensor and DTensor, need to convert
        all torch.Tensor to DTensor before calling distributed operators!
    """
    expect(outcomes[FSDP_CLIP], MATCH)


@pytest.mark.timeout(300)
def test_ddp_with_a_frozen_stage(outcomes: dict[Config, Outcome]) -> None:
    """Fixed on main (802ce3b: such a stage is not wrapped). A pinned split whose first stage
    holds only frozen parameters (``inp``, requires_grad
    False), under ``data_parallel="ddp"``; compile fails with torch's error, not a pipecut one
    (FSDP runs the same split and matches):

        File "compiler/api.py", line 298, in compile
        File "runtime/grads/data_parallel.py", line 150, in replicate
        File "runtime/grads/data_parallel.py", line 106, in _ddp
        RuntimeError: DistributedDataParallel is not needed when a module doesn't have any
        parameter that requires a gradient.
    """
    expect(outcomes[DDP_FROZEN_STAGE], MATCH)


@pytest.mark.timeout(300)
def test_fsdp_autocast_1f1b(outcomes: dict[Config, Outcome]) -> None:
    """Fixed on main (802ce3b: FSDP stages run without autocast's weight-cast cache).
    FSDP under bf16 (or fp16) autocast with 1F1B: the last stage, which runs F0 B0 F1 B1,
    gets gradients 0.48-0.72x the plain model's (norm ratio per tensor); the first stage (F0 F1
    B0 B1) and the same run under GPipe match, and so do DDP and fp32:

        step 0: rank 1 grad layers.3.0.bias: Tensor-likes are not close!
        Mismatched elements: 14 / 32 (43.8%)
        Greatest absolute difference: 0.0174713134765625 at index (11,) (up to 0.0066796875 allowed)

    With ``torch.autocast(..., cache_enabled=False)`` around ``pipe.step`` it matches: autocast
    keeps the bf16 copy of each parameter it cast until the autocast context exits, so the
    second forward reuses the copy made from FSDP's first unsharded parameter, which FSDP
    freed (resharded) after the first backward."""
    expect(outcomes[FSDP_AUTOCAST_1F1B], MATCH)


def test_fsdp_autocast_gpipe_matches(outcomes: dict[Config, Outcome]) -> None:
    """The control for the test above: every forward before any backward (matched before the fix)."""
    expect(outcomes[FSDP_AUTOCAST_GPIPE], MATCH)


def test_interleaved_with_one_stage_per_rank_runs_any_microbatch_count(outcomes: dict[Config, Outcome]) -> None:
    """Fixed (compiler/core/shapes.py): interleaved-1f1b with one stage per rank, K = 2, M = 3,
    a batch of 6: compile planned and built the pipeline, and every step, even with the very
    batch it was planned for, raised

        InputError: a batch of 6 does not split into at most 3 microbatches of 1..2 samples.
        This plan accepts microbatches of x: float32 [1..2, 16] (batch up to 6 in 3 microbatches)

    ``microbatch_sizes`` rounded M down to a multiple of K for every interleaved plan; only
    several stages per rank need that (one is plain 1F1B, whose generator runs any count).
    With several, M = 3 is refused with a ScheduleError naming the cause (asserted here too)."""
    expect(outcomes[INTERLEAVED_ODD], MATCH)
    expect(outcomes[INTERLEAVED_ODD_SEVERAL], refused(
        "ScheduleError", r"interleaved 1F1B needs the microbatches \(3\) to be a multiple of the ranks \(2\)"))


def test_an_automatic_schedule_with_data_parallelism_is_one_it_can_run(outcomes: dict[Config, Outcome]) -> None:
    """Fixed first by ruling the split-backward schedules out with replicas, then (issue 42) by
    running them: ``compile(mesh, microbatches="auto", schedule="auto", data_parallel="ddp")``
    chose ZBV, which it then refused:

        PlanError: data_parallel='ddp' cannot run the zbv schedule: its weight pass writes .grad
        with torch.autograd.grad, which neither DDP's nor FSDP's gradient hooks see; use
        schedule='1f1b' or 'gpipe'

    Found with compile's own split; replayed on a pinned one (``plan="split"``), which the
    choice does not depend on, so that measured times cannot change what runs."""
    expect(outcomes[AUTO_SCHEDULE_DDP], MATCH)


def test_an_automatic_count_for_interleaved_with_one_stage_per_rank(outcomes: dict[Config, Outcome]) -> None:
    """Fixed (compiler/planning/autoplan.py): a batch of 9 per replica on 2 ranks, interleaved-1f1b with
    one stage per rank, ``microbatches="auto"``: every count was skipped as not a multiple of
    the ranks (only several stages per rank need one), and compile refused with no reason:

        PartitionError: no microbatch count and schedule fits:

    Found with compile's own split (and heavy pieces); replayed on a pinned split as above."""
    expect(outcomes[AUTO_COUNT_INTERLEAVED], MATCH)


def test_eval_of_an_export_model_under_fsdp_is_refused(outcomes: dict[Config, Outcome]) -> None:
    """Refused since (it was silently wrong). A transformers model (captured by torch.export) under ``data_parallel="fsdp"``:
    ``pipe.eval()`` after an optimizer step runs on the weights the model had at compile, on
    every rank, silently (BERT, T5 and every other export-captured model; DDP, no data
    parallelism and symbolic_trace models match):

        after step 0: rank 0 eval loss: Scalars are not close!
        Expected 4.87271785736084 but got 4.876198768615723.

    4.876198768615723 is exactly the plain model's eval loss with its initial weights. For an
    export graph, compile builds the other mode's stage programs (compiler/capture/modes.py,
    ``Modes``) and points them at the training programs' parameter objects
    (``share_state``); ``runtime/data_parallel.replicate`` then wraps only ``pipe.workers``
    with ``fully_shard``, which swaps those modules' parameters for sharded DTensors, so the
    eval programs kept the replaced, never-updated tensors. ``pipe.eval()`` is now refused
    under FSDP where the other mode is a program of its own (``Modes.without_separate_mode``)."""
    expect(outcomes[FSDP_EVAL_STALE], refused("PlanError", r"eval mode under data_parallel='fsdp' is not supported"))


def test_a_float64_model_returns_its_loss_on_every_rank(outcomes: dict[Config, Outcome]) -> None:
    """Fixed (``runtime/grads.share_loss``: the loss travels as float64 with its dtype). With float64
    parameters, ``pipe.step`` returns on rank 0 (not the last stage) a loss rounded to float32
    (float32 default dtype: 1.9831985235214233 for 1.9831984639439244, found by the float64
    tolerance of tests/fuzz_check.py) or garbage (float64 default dtype):

        step 0: rank 0 loss of pipe.step call 0: Scalars are not close!
        Expected 1.7311136475577937 but got 5.29384542e-315.
    """
    expect(outcomes[FLOAT64_LOSS], MATCH)


def test_freezing_a_parameter_after_compile_under_ddp(outcomes: dict[Config, Outcome]) -> None:
    """Fixed (DDP's reducer is built again when the trainable set changes). A parameter
    frozen after ``compile`` for step 1 and unfrozen for step 2, 2 x 2 ranks under DDP: the
    step after the unfreeze fails with torch's error, not a pipecut one (without data
    parallelism, and under FSDP, the same loop matches):

        step 2 call 0: RuntimeError: Expected to have finished reduction in the prior iteration
        before starting a new one. This error indicates that your module has parameters that
        were not used in producing loss.
    """
    expect(outcomes[DDP_FREEZE], MATCH)
