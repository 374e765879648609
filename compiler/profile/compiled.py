"""Compiled or eager stages, chosen on the running pipeline (``compile_stages="auto"``).

Compiling a stage costs seconds to minutes once and may save milliseconds at every step, or
nothing (small kernels gain little from fusion; inductor's own kernels can be slower than the
library's). Neither is known before both have run here, so the ranks time their stages eager
(:func:`pipecut.profile.live.measure_stages`, as live calibration does), compile them in place,
time them again (the warm-up step compiles; what that took inside the compiler backend is the
compile time), and keep the compiled stages if the predicted saving over
:data:`AMORTIZED_STEPS` steps exceeds the compile time:

    compiled  iff  (eager step - compiled step) x AMORTIZED_STEPS > compile seconds

The stage times of the kept mode then calibrate the plan as usual, so its prediction is of the
stages that run. A later run with a warm inductor cache compiles in a fraction of the time
(``benchmarks/runtime.py`` gives both).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from pipecut.errors import PlanError
from pipecut.ir import Plan
from pipecut.options import AUTO
from pipecut.profile.calibrate import stage_times
from pipecut.profile.live import LiveTimes, measure_stages
from pipecut.runtime.execution.compiled import MIN_RUN, CompileStats, compile_program

__all__ = ["AMORTIZED_STEPS", "CompileChoice", "check_auto", "choose_compiled", "compiled_stage_times", "measure_and_choose"]


AMORTIZED_STEPS = 1000
"""Steps over which a compile must pay for itself: a short fine-tuning run, or a few minutes
of a pre-training run."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CompileChoice:
    """Eager against compiled stages on this pipeline, and the choice."""

    compiled: bool
    eager_step_ms: float
    compiled_step_ms: float
    compile_s: float
    """The slowest rank's seconds compiling (see ``CompileStats.seconds``)."""
    source: str = "measured"
    """Where the step times come from: "measured" on the running pipeline, "predicted" by a
    plan from stage times taken in one process."""
    graphs: int | None = None
    """The most graphs one rank compiled (None: not counted, as in a prediction). 0: nothing
    compiled (every stage compiled apart without a run of ops to compile), so eager is kept
    whatever the clock said: the "compiled" steps ran eagerly too."""

    def note(self) -> str:
        if self.graphs == 0:
            return (f"eager stages kept: no stage compiled a graph (each compiled apart from its parameter ops, "
                    f"no run of {MIN_RUN} or more other ops is left to compile)")
        kept = "compiled" if self.compiled else "eager"
        return (f"{kept} stages kept: {self.source} step {self.compiled_step_ms:.1f} ms compiled, "
                f"{self.eager_step_ms:.1f} ms eager; compiling took {self.compile_s:.1f} s "
                f"(kept compiled iff the saving over {AMORTIZED_STEPS} steps exceeds it)")


def choose_compiled(eager: LiveTimes, compiled: LiveTimes, compile_s: float, steps: int = AMORTIZED_STEPS,
                    graphs: int | None = None) -> CompileChoice:
    """The rule above, on measured steps; eager wherever ``graphs`` (the most one rank
    compiled) is 0."""
    saving_s = (eager.step_ms - compiled.step_ms) * steps / 1e3
    return CompileChoice(compiled=saving_s > compile_s and graphs != 0, eager_step_ms=eager.step_ms,
                         compiled_step_ms=compiled.step_ms, compile_s=compile_s, graphs=graphs)


def measure_and_choose(pipe: Any, inputs: Any, target: Any, steps: int) -> tuple[CompileChoice, LiveTimes]:
    """Time ``pipe``'s stages eager, compile every stage of every mode, time them again; keep
    the compiled stages or undo the compile, the same on every rank (rank 0's step times and
    the slowest rank's compile time decide). Returns the choice and the kept mode's times."""
    eager = measure_stages(pipe, inputs, target, steps)
    workers = pipe.built_workers()
    for w in workers:
        w.compile()
    compiled = measure_stages(pipe, inputs, target, steps)
    stats = pipe.compile_stats
    slowest = torch.tensor([sum(s.seconds for s in stats), sum(s.graphs for s in stats)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    decided: list[Any] = [choose_compiled(eager, compiled, float(slowest[0]), graphs=int(slowest[1]))]
    dist.broadcast_object_list(decided, src=0)
    choice: CompileChoice = decided[0]
    if not choice.compiled:
        for w in workers:
            w.uncompile()
    return choice, compiled if choice.compiled else eager


def compiled_stage_times(
    captured: Any, plan: Plan, inputs: Any, loss_fn: Any, target: Any, repeats: int = 3,
) -> tuple[list[tuple[float, float]], float]:
    """Every stage of ``plan`` compiled as ``compile_stages=True`` runs it, timed whole on one
    microbatch in one process (as :func:`~pipecut.profile.calibrate.stage_times` times eager
    stages), and the seconds compiling took: what ``pipecut.plan`` prices compiled stages by."""
    stats: list[CompileStats] = []

    def compiled(program: Any) -> None:
        stats.append(compile_program(program.module, program.index)[0])

    times = stage_times(captured, plan, inputs, loss_fn, target, repeats=repeats, prepare=compiled)
    return times, sum(s.seconds for s in stats)


def check_auto(value: bool | str, *, calibrates: bool, origin: str = "") -> None:
    """``compile_stages="auto"`` needs the live calibration steps to choose on. ``origin``:
    where the value came from when this call did not pass it ("recorded in the replayed plan's
    options"); empty where it did."""
    if value == AUTO and not calibrates:
        raise PlanError(
            f"compile_stages='auto'{f' ({origin})' if origin else ''} chooses on the live calibration steps, which a given plan=, "
            f"calibration_steps=0 or estimated costs (MeasureOptions(estimate=...)) skip; pass "
            f"{'runtime=RuntimeOptions(compile_stages=...) with ' if origin else ''}compile_stages=True or False"
        )
