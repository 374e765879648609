"""Replaying a plan: the arguments of ``compile`` either agree with the plan or are refused.

``compile(plan=...)`` runs the plan's own schedule, microbatches, stage layout and capture
method; an argument that says otherwise would be silently ignored, so it is an error instead.
Arguments left at None take the plan's value (or, without a plan, the default of
:data:`DEFAULTS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pipecut.cluster import Link
from pipecut.core.kinds import CaptureMethod, ScheduleKind
from pipecut.errors import PlanError
from pipecut.ir import Plan
from pipecut.options import AUTO, Options
from pipecut.passes.partition.solve import DEFAULT_LINK, as_devices, as_schedule
from pipecut.planning.request import default_choices

__all__ = ["Asked", "Settings", "asked"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """What ``compile`` runs with, every argument resolved."""

    microbatches: int
    schedule: ScheduleKind
    stages_per_rank: int
    link: Link
    capture_method: CaptureMethod | Literal["auto"]
    """"auto": symbolic_trace, then torch.export."""


DEFAULTS = Settings(
    microbatches=1, schedule=ScheduleKind.GPIPE, stages_per_rank=1, link=DEFAULT_LINK,
    capture_method=AUTO,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Asked:
    """What a ``compile`` call runs with (:class:`Settings`), and what it asks the planner."""

    run: Settings
    microbatches: int | Literal["auto"]
    """The microbatch count, or "auto"."""
    schedule: ScheduleKind | str
    """The schedule, or "auto"."""

    @property
    def auto(self) -> bool:
        """The planner chooses the microbatches or the schedule (before capture, at its count)."""
        return AUTO in (self.microbatches, self.schedule)


def asked(given: Plan | None, options: Options, devices: Any) -> Asked:
    """Resolve a ``compile`` call's scheduling against the plan it replays (``given``), or the
    defaults: left out without a plan, the planner chooses ("auto")."""
    s = options.scheduling
    m, kind = ((options.microbatches, options.schedule) if given is not None
               else default_choices(options.microbatches, options.schedule))
    if AUTO in (m, kind) and given is not None:
        raise PlanError(
            "microbatches/schedule='auto' ask the planner to choose, but plan= fixes them; drop "
            "plan= to plan again, or leave microbatches and schedule out to replay the plan"
        )
    run = settings(
        given, microbatches=m if isinstance(m, int) else None, schedule=None if kind == AUTO else kind,
        stages_per_rank=s.stages_per_rank, link=options.measure.link, capture_method=options.capture.method,
        devices=devices,
    )
    return Asked(run=run, microbatches=m if m is not None else run.microbatches,
                 schedule=kind if kind is not None else run.schedule)


def settings(
    plan: Plan | None,
    *,
    microbatches: int | None,
    schedule: str | ScheduleKind | None,
    stages_per_rank: int | None,
    link: Link | None,
    capture_method: CaptureMethod | Literal["auto"],
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
        if given not in (None, AUTO) and given != planned
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
