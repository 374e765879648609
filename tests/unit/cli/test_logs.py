"""pipecut.cli.logs: rank-prefixed logging, quiet off rank 0, progress bars."""

from __future__ import annotations

import io
import logging

import pytest

from pipecut.cli.logs import LOGGER_NAME, configure, env_rank, level_for, progress, show_progress


@pytest.mark.parametrize(("verbosity", "rank", "level"), [
    (-3, 0, logging.ERROR), (-1, 0, logging.ERROR), (0, 0, logging.WARNING), (1, 0, logging.INFO),
    (1, 2, logging.WARNING), (-1, 2, logging.ERROR), (2, 3, logging.DEBUG), (5, 0, logging.DEBUG),
])
def test_level_for(verbosity, rank, level):
    assert level_for(verbosity, rank) == level


def test_env_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert env_rank() == 3
    monkeypatch.setenv("RANK", "x")
    assert env_rank() == 0
    monkeypatch.delenv("RANK")
    assert env_rank() == 0


def test_configure_prefixes_the_rank_and_replaces_its_own_handler():
    logger = logging.getLogger(LOGGER_NAME)
    before = list(logger.handlers), logger.level, logger.propagate
    try:
        first, second = io.StringIO(), io.StringIO()
        configure(1, rank=2, stream=first)
        configure(1, rank=1, stream=second)
        assert sum(getattr(h, "_pipecut", False) for h in logger.handlers) == 1
        logging.getLogger("pipecut.planning.planner").warning("hello %d", 5)
        logging.getLogger("pipecut.planning.planner").info("hidden off rank 0")
        assert first.getvalue() == ""
        assert second.getvalue() == "[rank 1] WARNING pipecut.planning.planner: hello 5\n"
        assert logger.propagate is False
    finally:
        logger.handlers[:], logger.level, logger.propagate = before[0], before[1], before[2]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_show_progress_only_on_a_terminal_of_rank_0_unless_quiet():
    assert show_progress(0, Tty())
    assert not show_progress(1, Tty())
    assert not show_progress(0, Tty(), verbosity=-1)
    assert not show_progress(0, io.StringIO())


def test_progress_draws_only_when_enabled():
    out = Tty()
    with progress("profiling", enabled=True, stream=out) as cb:
        cb(1, 4)
        cb(4, 4)
    assert "profiling:" in out.getvalue() and "/4 [" in out.getvalue()
    quiet = Tty()
    with progress("profiling", enabled=False, stream=quiet) as cb:
        cb(2, 4)
    assert quiet.getvalue() == ""
