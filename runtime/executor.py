"""Run one rank's action list over the stage workers it holds (one, or several interleaved)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipecut.runtime.schedule import Action, ActionKind
from pipecut.runtime.stage import StageWorker

__all__ = ["Event", "run_actions"]


@dataclass(frozen=True, slots=True)
class Event:
    """One action's span on this rank, in seconds since the step started."""

    action: str
    start: float
    end: float


def run_actions(
    workers: Mapping[int, StageWorker],
    actions: Sequence[Action],
    inputs: Sequence[dict[str, Any]],
    targets: Sequence[Any],
    record: bool = False,
) -> tuple[torch.Tensor | None, list[Event]]:
    """Execute ``actions`` in order; the receive of the next action is posted before the
    current one computes. Returns this rank's share of the loss (None off the last stage)."""
    for w in workers.values():
        w.begin()
    events: list[Event] = []
    t0 = time.perf_counter()
    for i, action in enumerate(actions):
        for ahead in actions[i : i + 2]:
            workers[ahead.stage].post(ahead)
        worker = workers[action.stage]
        start = time.perf_counter()
        if action.kind is ActionKind.FORWARD:
            worker.forward(action.microbatch, inputs[action.microbatch], targets[action.microbatch])
        elif action.kind is ActionKind.BACKWARD:
            worker.backward(action.microbatch)
        elif action.kind is ActionKind.INPUT:
            worker.backward(action.microbatch, weights_later=True)
        else:
            worker.backward_weight(action.microbatch)
        if record:
            events.append(Event(str(action), start - t0, time.perf_counter() - t0))
    for w in workers.values():
        w.finish_sends()
    losses = [loss for w in workers.values() if (loss := w.loss()) is not None]
    return (losses[0] if losses else None), events
