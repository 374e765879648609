"""Replaying a plan: the arguments of ``compile`` either agree with the plan or are refused.

``compile(plan=...)`` runs the plan's own schedule, microbatches, stage layout and capture
method; an argument that says otherwise would be silently ignored, so it is an error instead.
:func:`settings_of` checks a call against the plan it replays, then resolves it once
(:func:`pipecut.planning.asked.resolve`): arguments left out take the plan's value or, without a
plan, the defaults (the planner chooses what is left "auto").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipecut.core.kinds import CaptureMethod, ScheduleKind
from pipecut.errors import PlanError
from pipecut.ir import Plan
from pipecut.options import AUTO, Options
from pipecut.passes.partition.solve import as_devices, as_schedule
from pipecut.planning.asked import Context, Resolved, resolve

__all__ = ["settings_of"]


def settings_of(given: Plan | None, options: Options, devices: Any) -> Resolved:
    """A ``compile`` call's options (``options``, ``devices``) resolved against the plan it
    replays (``given``), or without one (:func:`~pipecut.planning.asked.resolve`: the planner
    chooses what is left "auto"); PlanError naming every argument that contradicts ``given``."""
    s = options.scheduling
    if given is None:
        return resolve(options, Context.COMPILE, devices=devices)
    if AUTO in (options.microbatches, options.schedule):
        raise PlanError(
            "microbatches/schedule='auto' ask the planner to choose, but plan= fixes them; drop "
            "plan= to plan again, or leave microbatches and schedule out to replay the plan"
        )
    kind = as_schedule(options.schedule) if options.schedule is not None else None
    asked = {
        "microbatches": (options.microbatches, given.microbatches),
        "schedule": (kind, given.schedule),
        "stages_per_rank": (s.stages_per_rank, given.stages_per_rank),
        "link": (options.measure.link, given.link),
        "capture_method": (options.capture.method, given.capture),
    }
    conflicts = [
        f"{name}={_show(value)} (the plan has {_show(planned)})"
        for name, (value, planned) in asked.items()
        if value not in (None, AUTO) and value != planned
    ]
    conflicts += _device_conflicts(given, devices)
    if conflicts:
        raise PlanError(
            f"compile(plan=...) runs the plan's own settings, but {'; '.join(conflicts)}. Leave "
            f"these arguments out (None) to replay the plan as it is, or re-plan with them "
            f"(compile without plan=, or pipecut.plan(...))"
        )
    return resolve(options, Context.REPLAY, plan=given, devices=devices)


def _device_conflicts(plan: Plan, devices: Any) -> list[str]:
    if devices is None or hasattr(devices, "mesh_dim_names"):
        return []  # the process group's size is checked against the plan once it is known
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices != plan.num_ranks:
            return [f"devices={devices} (the plan is for {plan.num_ranks} ranks)"]
        return []
    given = as_devices(devices)
    planned = plan.devices[: plan.num_ranks]
    if tuple(given) != tuple(planned):
        return [f"devices={_show(given)} (the plan has {_show(planned)})"]
    return []


def _show(value: Any) -> str:
    if isinstance(value, (ScheduleKind, CaptureMethod)):
        return repr(value.value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)
