"""``compile_stages="auto"``: the rule that keeps compiled or eager stages, and its inputs.

The measuring half (:func:`pipecut.profile.compiled.measure_and_choose`) runs on the ranks in
``tests/dist/test_runtime_compiled.py``.
"""

from __future__ import annotations

import pytest

from pipecut.errors import InputError, PlanError
from pipecut.options import RuntimeOptions
from pipecut.profile.compiled import AMORTIZED_STEPS, CompileChoice, check_auto, choose
from pipecut.profile.live import LiveTimes


def _times(step_ms: float) -> LiveTimes:
    return LiveTimes(stages=((1.0, 2.0), (1.0, 2.0)), step_ms=step_ms)


def test_compiled_kept_when_the_saving_over_the_amortized_steps_exceeds_the_compile_time() -> None:
    # 10 ms saved per step over 1000 steps is 10 s: a 9 s compile pays, an 11 s one does not.
    assert AMORTIZED_STEPS == 1000
    assert choose(_times(110.0), _times(100.0), compile_s=9.0).compiled
    assert not choose(_times(110.0), _times(100.0), compile_s=11.0).compiled
    slower = choose(_times(100.0), _times(110.0), compile_s=0.0)  # compiled is slower: never kept
    assert not slower.compiled
    assert choose(_times(110.0), _times(100.0), compile_s=11.0, steps=2000).compiled


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
    with pytest.raises(PlanError, match=r"compile_stages='auto' chooses on the live calibration steps"):
        check_auto("auto", calibrates=False)
