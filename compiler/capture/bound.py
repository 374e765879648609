"""A wall-clock bound on one capture attempt, that really interrupts it.

torch.export with symbolic shapes can spend minutes (or hours) in sympy simplifying shape
expressions: a Swin transformer whose image height and width are symbolic never finished in
10 minutes, in pure Python, with no word. A thread cannot be stopped from outside, but the
main thread can be interrupted: :func:`time_bound` arms ``SIGALRM`` (``signal.setitimer``) and
its handler raises :class:`Expired` in the main thread at the next bytecode, wherever sympy is.
:class:`Expired` is a ``BaseException``, so the ``except Exception`` blocks inside torch and
sympy let it through and the context managers of export unwind as for any error. It is not
raised inside an import or a context manager's ``__exit__`` (a half-run module or half-restored
state would break the next trace: torch.export imports lazily): the handler then tries again
20 ms later, and so it waits while torch's own code outside its shape reasoning runs (the
dispatcher calls some of it from C++ frames an exception must not cross): it lands in sympy, the
``ShapeEnv`` or the model's code. :func:`check_unchanged` verifies that the process-wide state torch's tracers
change was put back.

Where no such signal can be armed (capture called off the main thread, or on a platform without
``setitimer``), the attempt runs unbounded and the caller is told so (:attr:`Bound.armed`).
A timer already armed by someone else (pytest-timeout arms ``SIGALRM`` too) is kept: its
handler still runs at its own deadline, and its remaining time is re-armed afterwards.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from pipecut.core.torch_private import (
    dispatch_mode_depth,
    function_mode_depth,
    functorch_transforms_active,
    fx_tracing,
    in_tracing_context,
)
from pipecut.errors import CaptureError

__all__ = ["Bound", "Expired", "can_bound", "check_unchanged", "time_bound", "torch_state"]

_EPSILON = 1e-3  # a timer may fire a hair early: treat deadlines within this as due
_RETRY = 0.02  # seconds until the next try where the signal fell in an unsafe place


class Expired(BaseException):
    """Raised in the main thread when a :func:`time_bound` runs out (a BaseException: torch's
    own ``except Exception`` blocks must not swallow it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bound:
    """What :func:`time_bound` could arm."""

    seconds: float
    """The bound asked for (``math.inf``: unbounded)."""
    armed: bool
    """Whether it is enforced (False: unbounded, asked so or unable to)."""


def can_bound() -> bool:
    """Whether this thread can arm the timer: the main thread of a platform with ``setitimer``."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_bound(seconds: float) -> Iterator[Bound]:
    """Raise :class:`Expired` in the block once ``seconds`` of wall-clock time have passed.

    ``seconds`` ``math.inf`` (a deadline never due), or a thread that cannot arm the timer (see
    :func:`can_bound`): the block runs unbounded and the :class:`Bound` yielded says
    ``armed=False``.

    >>> with time_bound(math.inf) as b:
    ...     b.armed
    False
    """
    if seconds == math.inf or not can_bound():
        yield Bound(seconds=seconds, armed=False)
        return
    previous = signal.getsignal(signal.SIGALRM)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, 0)  # read and pause it
    start = time.monotonic()
    deadline = start + max(seconds, 0.0)
    outer = start + outer_delay if outer_delay > 0 else None

    def rearm(now: float) -> None:
        due = min(d for d in (deadline, outer) if d is not None)
        signal.setitimer(signal.ITIMER_REAL, max(due - now, _EPSILON))

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        nonlocal outer
        now = time.monotonic()
        if outer is not None and now >= outer - _EPSILON:
            # the other timer's own moment: its handler acts as it would have, and a periodic
            # timer comes round again
            outer = now + outer_interval if outer_interval > 0 else None
            _call(previous, signum, frame)
        if now >= deadline - _EPSILON:
            if _unsafe(frame) or _in_torch(frame):  # not here: in a moment, somewhere safe
                signal.setitimer(signal.ITIMER_REAL, _RETRY)
                return
            raise Expired(f"no result after {seconds:g} s")
        rearm(now)

    signal.signal(signal.SIGALRM, on_alarm)
    try:
        rearm(start)
        yield Bound(seconds=seconds, armed=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer is not None:  # the other timer, with the time it had left
            signal.setitimer(signal.ITIMER_REAL, max(outer - time.monotonic(), _EPSILON), outer_interval)


def _unsafe(frame: FrameType | None) -> bool:
    """Whether raising in ``frame`` could leave the process half-changed: inside an import (a
    module half run, whose registrations clash when it is imported again; torch.export imports
    lazily) or inside an ``__exit__`` (a context manager putting global state back)."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or code.co_name in ("__exit__", "__aexit__"):
            return True
        frame = frame.f_back
    return False


_SAFE_IN_TORCH = ("/torch/utils/_sympy/", "/torch/fx/experimental/symbolic_shapes.py")


def _in_torch(frame: FrameType | None) -> bool:
    """Whether the code running when the signal came is torch's own, outside its shape
    reasoning: an exception raised there can cross one of torch's C++ frames that cannot carry
    it (seen: ``find_torch_dispatch_rule`` under the dispatcher, and the process aborted with
    ``terminate called after throwing pybind11::error_already_set``). Sympy, torch's sympy
    helpers and the ``ShapeEnv`` (where a symbolic export spends its long minutes), and code
    outside torch, are places an error is routinely raised from and unwinds cleanly."""
    if frame is None:
        return False
    name = frame.f_code.co_filename.replace("\\", "/")
    return "/torch/" in name and not any(safe in name for safe in _SAFE_IN_TORCH)


def _call(handler: Any, signum: int, frame: FrameType | None) -> None:
    """Run the handler that was installed before ours, as the signal would have."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:  # the default for SIGALRM ends the process: do so
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGALRM)


def torch_state() -> dict[str, Any]:
    """The process-wide state a trace changes and puts back on its way out (patched Module
    methods, mode stacks, the tracing flags, grad mode): compared before and after an
    interrupted attempt by :func:`check_unchanged`."""
    module = torch.nn.Module
    return {
        "Module.__call__": module.__call__,
        "Module.__getattr__": module.__getattr__,
        "Module.__setattr__": module.__setattr__,
        "torch dispatch modes": dispatch_mode_depth(),
        "torch function modes": function_mode_depth(),
        "functorch transforms": functorch_transforms_active(),
        "fx tracing": fx_tracing(),
        "tracing context": in_tracing_context(),
        "grad enabled": torch.is_grad_enabled(),
    }


def check_unchanged(before: dict[str, Any], what: str) -> None:
    """Refuse to go on where an interrupted attempt left torch changed (the interruption fell
    in the code that puts it back): a later trace would run in that state."""
    after = torch_state()
    changed = [k for k in before if after[k] != before[k]]
    if changed:
        raise CaptureError(
            f"capturing {what}: interrupting torch.export at its time limit left torch's state "
            f"changed ({', '.join(changed)}), so this process cannot trace again safely; pass "
            f"CaptureOptions(dynamic_shapes=False) to export at static shapes without the wait, "
            f"or time_limit='unbounded' to let the symbolic export finish"
        )
