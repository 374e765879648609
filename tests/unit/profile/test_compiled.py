"""``compile_stages="auto"``: the rule that keeps compiled or eager stages, and its inputs.

The measuring half (:func:`pipecut.profile.compiled.measure_and_choose`) runs on the ranks in
``tests/multiprocess/test_execution_compiled.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipecut.errors import InputError, PlanError
from pipecut.options import RuntimeOptions
from pipecut.profile.compiled import AMORTIZED_STEPS, CompileChoice, check_auto, choose_compiled
from pipecut.profile.live import LiveTimes


def _times(step_ms: float) -> LiveTimes:
    return LiveTimes(stages=((1.0, 2.0), (1.0, 2.0)), step_ms=step_ms)


def test_compiled_kept_when_the_saving_over_the_amortized_steps_exceeds_the_compile_time() -> None:
    # 10 ms saved per step over 1000 steps is 10 s: a 9 s compile pays, an 11 s one does not.
    assert AMORTIZED_STEPS == 1000
    assert choose_compiled(_times(110.0), _times(100.0), compile_s=9.0).compiled
    assert not choose_compiled(_times(110.0), _times(100.0), compile_s=11.0).compiled
    slower = choose_compiled(_times(100.0), _times(110.0), compile_s=0.0)  # compiled is slower: never kept
    assert not slower.compiled
    assert choose_compiled(_times(110.0), _times(100.0), compile_s=11.0, steps=2000).compiled


def test_eager_is_kept_where_no_rank_compiled_a_graph() -> None:
    # the "compiled" steps ran eagerly too (stages compiled apart with nothing to compile): the
    # clock's difference is noise, and the note says why eager stays
    nothing = choose_compiled(_times(110.0), _times(100.0), compile_s=0.0, graphs=0)
    assert not nothing.compiled
    assert nothing.note().startswith("eager stages kept: no stage compiled a graph")
    assert choose_compiled(_times(110.0), _times(100.0), compile_s=0.0, graphs=1).compiled


def test_the_choice_reads_as_a_note() -> None:
    note = CompileChoice(compiled=True, eager_step_ms=110.0, compiled_step_ms=100.0, compile_s=9.0).note()
    assert note.startswith("compiled stages kept: measured step 100.0 ms compiled, 110.0 ms eager")
    assert "compiling took 9.0 s" in note


def test_compile_stages_values() -> None:
    check_auto(True, calibrates=False)
    check_auto("auto", calibrates=True)
    assert RuntimeOptions(compile_stages="auto").compile_stages == "auto"
    with pytest.raises(InputError, match=r"RuntimeOptions\(compile_stages='yes'\): use True, False or 'auto'"):
        RuntimeOptions(compile_stages="yes")
    with pytest.raises(PlanError, match=r"compile_stages='auto' chooses on the live calibration steps.*; pass "
                                        r"compile_stages=True or False$"):
        check_auto("auto", calibrates=False)


def test_compile_stages_auto_carried_by_a_replayed_plan_is_named_as_the_plans() -> None:
    """compile(plan=...) without runtime= runs with the plan's recorded runtime options: a
    compile_stages="auto" there is refused as the plan's, with what to pass (the asked case
    names no origin)."""
    import dataclasses

    import pipecut
    from tests.unit.tiny import _mlp as tiny_mlp
    from tests.unit.tiny import mlp_plan

    plan = mlp_plan(2)
    assert plan.options is not None
    auto = dataclasses.replace(plan, options=dataclasses.replace(plan.options, runtime=RuntimeOptions(compile_stages="auto")))
    model, inputs, loss_fn, target = tiny_mlp()
    with pytest.raises(PlanError, match=r"compile_stages='auto' \(recorded in the replayed plan's options\) chooses on "
                                        r"the live calibration steps.*; pass runtime=RuntimeOptions\(compile_stages=...\) "
                                        r"with compile_stages=True or False"):
        pipecut.compile(model, inputs, 2, loss_fn=loss_fn, target=target, plan=auto)
    with pytest.raises(PlanError, match=r"compile_stages='auto' chooses on the live calibration steps.*; pass "
                                        r"compile_stages=True or False$"):
        pipecut.compile(model, inputs, 2, loss_fn=loss_fn, target=target, plan=plan,
                        runtime=RuntimeOptions(compile_stages="auto"))


def _mlp() -> Any:
    from examples import mlp

    return mlp.build(8, width=16, depth=2)


def _mlp_plan(runtime: RuntimeOptions) -> Any:
    import pipecut

    model, inputs, loss_fn, target = _mlp()
    return pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2, schedule="1f1b",
                        measure=pipecut.MeasureOptions(repeats=2, warmup=0), runtime=runtime,
                        partition=pipecut.PartitionOptions(heavy_pieces=False))


def test_plan_prices_compiled_stages_with_the_compile_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import pipecut
    import pipecut.planning.planner as planner

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with torch._inductor.config.patch(compile_threads=1):
        real = _mlp_plan(RuntimeOptions(compile_stages=True))  # compiled for real, in one process
    assert "stages priced compiled (compiling took" in real.solver.detail
    assert real.options.runtime.compile_stages is True

    # Set stage times (no clock): eager 1 + 2 ms per stage, compiled half that.
    monkeypatch.setattr(planner, "stage_times", lambda on, plan, *a, **k: [(1.0, 2.0)] * plan.num_stages)

    def compiled(seconds: float) -> Any:
        return lambda on, plan, *a, **k: ([(0.5, 1.0)] * plan.num_stages, seconds)

    monkeypatch.setattr(planner, "compiled_stage_times", compiled(0.0))
    kept = _mlp_plan(RuntimeOptions(compile_stages="auto"))
    assert "compiled stages kept: predicted step" in kept.solver.detail
    monkeypatch.setattr(planner, "compiled_stage_times", compiled(1e9))  # never pays for itself
    eager = _mlp_plan(RuntimeOptions(compile_stages="auto"))
    assert "eager stages kept: predicted step" in eager.solver.detail

    model, inputs, loss_fn, target = _mlp()
    with pytest.raises(InputError, match=r"compile_stages=True\) prices the stages compiled by timing them whole "
                                         r"here, which this plan does not: calibration is off"):
        pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2, schedule="1f1b",
                     measure=pipecut.MeasureOptions(calibrate=False), runtime=RuntimeOptions(compile_stages=True))
    with pytest.raises(InputError, match=r"plan\(cluster=...\) estimates costs .* cannot price compiled stages"):
        pipecut.plan(model, inputs, cluster="1x2xH100-SXM", microbatches=2,
                     runtime=RuntimeOptions(compile_stages=True))
