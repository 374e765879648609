"""Every rank captures the graph its plan names, though a time limit may run out on one rank only.

A symbolic-shape torch.export bounded by ``CaptureOptions.time_limit`` (see
:mod:`pipecut.capture.bound`) falls back to static shapes where it runs past the limit, and a
rank that is slowed down (its neighbours, a loaded machine) may fall back where rank 0 did not,
or the reverse. The two graphs differ (the symbolic one reads sizes with ``sym_size`` nodes), so
their fingerprints do: :func:`capture_for_plan` tries the other shapes mode where the first
capture does not give the plan's fingerprint, and says why where neither does because of the
time limit. A replayed plan made at static shapes is captured at static shapes first, without
waiting for the symbolic export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch

from pipecut.capture.trace import capture_as, fingerprint
from pipecut.core.kinds import CaptureMethod
from pipecut.core.program import Captured, Inputs, Shapes
from pipecut.errors import CaptureError
from pipecut.ir import Plan
from pipecut.options import AUTO, UNBOUNDED, CaptureOptions, limit_seconds

__all__ = ["REPLAY_SLACK", "capture_for_plan", "static_plan"]


def static_plan(plan: Plan) -> bool:
    """Whether ``plan`` accepts only its planned shapes (every dimension of every input fixed):
    its graph was likely exported at static shapes, so try those first."""
    return bool(plan.accepts) and all(s.min_shape == s.max_shape for s in plan.accepts)


def capture_for_plan(
    model: torch.nn.Module,
    inputs: Inputs,
    plan: Plan,
    options: CaptureOptions,
    *,
    method: CaptureMethod | Literal["auto"] = AUTO,
    got: Captured | None = None,
) -> Captured:
    """``model`` captured on ``inputs`` (the plan's first microbatch) as the graph ``plan``
    names, if either shapes mode of torch.export gives it; else the first capture, which the
    caller's fingerprint check refuses (another model). ``got``: a capture made already (with
    ``options``), kept if it matches. CaptureError where the plan's graph has symbolic shapes
    and this rank's symbolic export ran past the time limit."""
    tried: list[Captured] = [got] if got is not None else []
    if got is not None and _matches(got, plan):
        return got
    first_static = static_plan(plan) if got is None else not got.static_shapes
    for static in (first_static, not first_static):
        if any(c.static_shapes == static or c.method is CaptureMethod.SYMBOLIC_TRACE for c in tried):
            continue  # that mode gave its graph already (symbolic_trace has no shapes mode)
        limit = _limit(options, replaying=static == static_plan(plan))
        captured = capture_as(model, inputs, dataclasses.replace(options, dynamic_shapes=not static, time_limit=limit),
                              method=method)
        if _matches(captured, plan):
            return captured
        tried.append(captured)
    _refuse_timed_out(tried, plan, options)
    return tried[0]


REPLAY_SLACK = 10.0
"""How much longer than ``CaptureOptions.time_limit`` a rank waits for the export in the shapes
mode its plan was made in: that export finished on the planning rank within the limit for this
model and these inputs, so a rank that is merely slower (a loaded machine) still gets there,
while one that never would is still stopped."""


def _limit(options: CaptureOptions, *, replaying: bool) -> float | Literal["unbounded"]:
    """The time limit of one attempt, as an option's value (the attempt is made with options)."""
    if options.time_limit == UNBOUNDED or not replaying:
        return options.time_limit
    return options.time_limit * REPLAY_SLACK


def _matches(captured: Captured, plan: Plan) -> bool:
    return fingerprint(captured.gm) == plan.fingerprint


def _refuse_timed_out(tried: Sequence[Captured], plan: Plan, options: CaptureOptions) -> None:
    if any(c.shapes is Shapes.TIMED_OUT for c in tried):
        raise CaptureError(
            f"this rank's graph at static shapes is not the plan's (fingerprint {plan.fingerprint}): "
            f"that is torch.export's with symbolic shapes (or another model's), and here that export "
            f"ran past {limit_seconds(_limit(options, replaying=True)):g} s ({REPLAY_SLACK:g} x "
            f"CaptureOptions(time_limit={limit_seconds(options.time_limit):g})); plan and compile with "
            f"CaptureOptions(dynamic_shapes=False) (every rank then exports at static shapes) or with "
            f"a larger time_limit"
        )
