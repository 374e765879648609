"""``compile`` closes what it opened: its process groups are destroyed at a clean exit.

Why a script needs this. A gloo process group runs worker threads; each collective's work
object holds the tensors it reduced, and the worker thread drops its reference only after the
caller's ``wait`` has returned. When the script ends right after a collective, that drop can
come while the interpreter is finalising: freeing a tensor whose Python object is still alive
takes the GIL, a thread taking the GIL during finalisation is made to exit, the forced unwind
meets a ``noexcept`` frame, and ``std::terminate`` aborts the rank ("terminate called without
an active exception", SIGABRT; torchrun then kills the other ranks). Seen: a core dump of a
4-line gloo script (one ``all_gather``, no ``destroy_process_group``) shows exactly that stack
(``AsyncAllgatherWork::~AsyncAllgatherWork`` → ``decref`` → ``take_gil`` →
``PyThread_exit_thread`` → ``std::terminate``), in 3 of 10 runs at 2 ranks, 0 of 10 with
``destroy_process_group()`` at the end. torch itself registers no exit hook for this
(pytorch/pytorch#179291 proposed one and was withdrawn). Destroying the groups while the
interpreter is still whole joins the worker threads first.

The mechanism: a ``weakref.finalize`` on each process group pipecut opens (the default group
when ``compile`` initialised it from torchrun's environment, the groups of tied weights, the
mesh of ``data_parallel="auto"``), holding only a weak reference to it. ``weakref.finalize``
runs pending finalizers at exit, before the interpreter tears down, newest first (subgroups
before the default group). A group destroyed earlier (by the user, or by
:func:`pipecut.runtime.comm.failure.abort`) is no longer open then, and nothing is done. No module
state: each group carries its own finalizer, and one that is gone takes it along. A group
the user opened is the user's to close; and after an uncaught exception nothing is destroyed
(with NCCL, destroying while other ranks still wait in a collective can hang: the rank is
failing anyway, as torchtitan's trainer does).
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from pipecut.runtime.comm.launch import ensure_process_group

__all__ = ["close_at_exit", "open_default_group"]


def open_default_group(timeout: datetime.timedelta, device: torch.device) -> None:
    """``ensure_process_group``; a default group it initialised is destroyed at a clean exit."""
    opened = not dist.is_initialized()
    ensure_process_group(timeout, device)
    if opened:
        close_at_exit([dist.group.WORLD])


def close_at_exit(groups: Iterable[Any]) -> list[weakref.finalize]:
    """Destroy each of ``groups`` (process groups this rank is a member of; others are
    skipped) at a clean interpreter exit, if it is still open then. Returns the finalizers
    (calling one runs it now, once)."""
    return [weakref.finalize(g, _close, weakref.ref(g)) for g in groups if isinstance(g, dist.ProcessGroup)]


def _close(ref: weakref.ref[dist.ProcessGroup]) -> None:
    """Runs at exit (or, doing nothing, once the group is gone)."""
    group = ref()
    failing = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # an uncaught exception
    if group is None or not dist.is_initialized() or failing is not None:
        return
    with contextlib.suppress(ValueError):  # destroyed already: "Invalid process group specified"
        if group is dist.group.WORLD:
            dist.destroy_process_group()  # every group left, the default one last
        else:
            dist.destroy_process_group(group)
