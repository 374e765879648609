"""pipecut.errors: user mistakes are ValueError/TypeError, runtime mismatches RuntimeError."""

from __future__ import annotations

import pytest

import pipecut.errors as errors
from pipecut.errors import (
    CaptureError,
    InputError,
    PartitionError,
    PipecutError,
    PipelineRuntimeError,
    PlanError,
    ScheduleError,
)


@pytest.mark.parametrize(("error", "builtin"), [
    (CaptureError, ValueError), (InputError, TypeError), (PartitionError, ValueError),
    (PlanError, ValueError), (ScheduleError, ValueError), (PipelineRuntimeError, RuntimeError),
])
def test_each_error_is_a_pipecut_error_and_its_builtin(error, builtin):
    with pytest.raises(PipecutError, match="stage 2"):
        raise error("stage 2: the fix")
    with pytest.raises(builtin):
        raise error("x")


def test_user_errors_are_not_runtime_errors():
    for error in (CaptureError, InputError, PartitionError, PlanError, ScheduleError):
        assert not issubclass(error, RuntimeError)
    assert not issubclass(PipelineRuntimeError, (ValueError, TypeError))


def test_all_lists_every_error_class():
    classes = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, PipecutError)}
    assert classes == set(errors.__all__)
