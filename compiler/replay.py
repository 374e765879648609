"""Replaying a plan: the arguments of ``compile`` either agree with the plan or are refused.

``compile(plan=...)`` runs the plan's own schedule, microbatches, stage layout and capture
method; an argument that says otherwise would be silently ignored, so it is an error instead.
Arguments left at None take the plan's value (or, without a plan, the default of
:data:`DEFAULTS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipecut.errors import PlanError
from pipecut.plan import CaptureMethod, Link, Plan, ScheduleKind
from pipecut.planning.partition import DEFAULT_LINK, as_devices, as_schedule

__all__: list[str] = []


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """What ``compile`` runs with, every argument resolved."""

    microbatches: int
    schedule: ScheduleKind
    stages_per_rank: int
    link: Link
    capture_method: CaptureMethod | None
    """None: symbolic_trace, then torch.export."""


DEFAULTS = Settings(
    microbatches=1, schedule=ScheduleKind.GPIPE, stages_per_rank=1, link=DEFAULT_LINK,
    capture_method=None,
)


def settings(
    plan: Plan | None,
    *,
    microbatches: int | None,
    schedule: str | ScheduleKind | None,
    stages_per_rank: int | None,
    link: Link | None,
    capture_method: CaptureMethod | None,
    devices: Any,
) -> Settings:
    """Resolve the arguments of ``compile``; PlanError naming every one that contradicts ``plan``."""
    kind = as_schedule(schedule) if schedule is not None else None
    if plan is None:
        return Settings(
            microbatches=DEFAULTS.microbatches if microbatches is None else microbatches,
            schedule=kind or DEFAULTS.schedule,
            stages_per_rank=DEFAULTS.stages_per_rank if stages_per_rank is None else stages_per_rank,
            link=link or DEFAULTS.link,
            capture_method=capture_method,
        )
    asked = {
        "microbatches": (microbatches, plan.microbatches),
        "schedule": (kind, plan.schedule),
        "stages_per_rank": (stages_per_rank, plan.stages_per_rank),
        "link": (link, plan.link),
        "capture_method": (capture_method, plan.capture),
    }
    conflicts = [
        f"{name}={_show(given)} (the plan has {_show(planned)})"
        for name, (given, planned) in asked.items()
        if given is not None and given != planned
    ]
    conflicts += _device_conflicts(plan, devices)
    if conflicts:
        raise PlanError(
            f"compile(plan=...) runs the plan's own settings, but {'; '.join(conflicts)}. Leave "
            f"these arguments out (None) to replay the plan as it is, or re-plan with them "
            f"(compile without plan=, or pipecut.plan(...))"
        )
    return Settings(
        microbatches=plan.microbatches, schedule=plan.schedule,
        stages_per_rank=plan.stages_per_rank, link=plan.link, capture_method=plan.capture,
    )


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
