"""Schedules, in one package: the format, the generators and the one simulator.

:mod:`~pipecut.schedules.format` (actions, their text form, which rank runs a stage, the checks
every schedule passes), :mod:`~pipecut.schedules.simulate` (a step's timeline and time from
per-stage costs), :mod:`~pipecut.schedules.standard` (GPipe, 1F1B, interleaved 1F1B, and the
dispatch by :class:`~pipecut.core.kinds.ScheduleKind`), :mod:`~pipecut.schedules.zero_bubble`
and :mod:`~pipecut.schedules.zbv`. A schedule is plan data: the runtime replays it and the
passes price it, so this package sits in the data layer, below both; its generators and the
simulator are pure functions over numbers and names.
"""

__all__: list[str] = []
