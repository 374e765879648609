"""Logging and progress bars that behave under torchrun: rank-prefixed, quiet off rank 0.

Nothing here runs at import time. A program (the CLI, a training script) calls
:func:`configure` once; library code only uses ``logging.getLogger(__name__)`` and takes a
``progress`` callback, so it never prints by itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import IO

from tqdm import tqdm

__all__ = [
    "LOGGER_NAME",
    "RankFormatter",
    "configure",
    "env_rank",
    "level_for",
    "progress",
    "show_progress",
]

LOGGER_NAME = "pipecut"

_LEVELS = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}
"""Verbosity to level: ``-q`` is -1, the default 0, ``-v`` 1, ``-vv`` (or more) DEBUG."""


def level_for(verbosity: int, rank: int = 0) -> int:
    """The log level for a verbosity; ranks other than 0 show warnings and errors only (unless -vv)."""
    if verbosity >= 2:
        return logging.DEBUG
    level = _LEVELS[max(verbosity, -1)]
    return level if rank == 0 else max(level, logging.WARNING)


def env_rank() -> int:
    """This process's rank as torchrun sets it (``RANK``), or 0 outside torchrun."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankFormatter(logging.Formatter):
    """``[rank 1] WARNING pipecut.planning.planner: message`` so interleaved ranks can be told apart."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        self.rank = rank


def configure(verbosity: int = 0, rank: int | None = None, stream: IO[str] | None = None) -> logging.Logger:
    """Set up the ``pipecut`` logger once per process; calling again replaces its handler.

    Only the ``pipecut`` logger is touched (not the root logger), so an application's own
    logging setup is left alone.
    """
    rank = env_rank() if rank is None else rank
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        if getattr(handler, "_pipecut", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(RankFormatter(rank))
    handler._pipecut = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level_for(verbosity, rank))
    logger.propagate = False
    return logger


def show_progress(rank: int, stream: IO[str] | None = None, verbosity: int = 0) -> bool:
    """Bars only on rank 0, on a terminal, and not when asked to be quiet."""
    stream = stream if stream is not None else sys.stderr
    return rank == 0 and verbosity >= 0 and bool(getattr(stream, "isatty", lambda: False)())


@contextlib.contextmanager
def progress(
    desc: str, *, enabled: bool, stream: IO[str] | None = None
) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback for ``pipecut.plan`` drawing a tqdm bar.

    >>> with progress("profiling", enabled=False) as cb:
    ...     cb(1, 10)
    """
    bar: tqdm | None = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="node", disable=not enabled,
                       file=stream if stream is not None else sys.stderr, leave=False)
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
