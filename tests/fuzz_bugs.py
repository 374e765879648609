"""Bugs the differential fuzzer knows about and that are still open: which configurations hit
each one, so that the fixed budget (tests/multiprocess/test_fuzz.py) leaves them out and a campaign
(benchmarks/fuzz.py) can tell a known failure from a new one.

Each entry says which configurations hit the bug, as narrowly as the shrunk repros allow (a
wide predicate hides new bugs behind a known one). Every entry has a strict xfail in
tests/multiprocess/test_fuzz_regressions.py with its shrunk configuration: when a fix lands, that test
XPASSes, and the entry and the mark go together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tests.fuzz_config import Config


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KnownBug:
    what: str
    """The symptom and, where known, the cause and who is fixing it."""
    found: str = "reported"
    """``reported`` (known before this fuzzer's campaign found it) or ``fuzzer`` (found by it)."""
    hits: Callable[[Config], bool]
    """Whether a configuration runs into it."""


KNOWN: dict[str, KnownBug] = {
    "swin-export": KnownBug(
        what="transformers Swin: torch.export reasons about its symbolic image sizes for minutes; capture "
             "now stops after CaptureOptions.time_limit (30 s) and exports at static shapes, so a Swin "
             "configuration takes about a minute per rank: too slow for the fixed budget, not wrong",
        hits=lambda c: c.model == "swin"),
}
"""Open bugs by short name."""


def known(cfg: Config, ran: tuple[str, int] | None = None) -> list[str]:
    """The known bugs ``cfg`` runs into, by name; ``ran``: the schedule and microbatch count its
    ranks ran, where compile chose them (see :func:`effective`)."""
    cfg = effective(cfg, ran)
    return [name for name, bug in KNOWN.items() if bug.hits(cfg)]


def effective(cfg: Config, ran: tuple[str, int] | None) -> Config:
    """``cfg`` with compile's choice of schedule and microbatches (``ran``) made explicit, so
    that a predicate sees what ran, not "auto"."""
    if ran is None or not cfg.choose:
        return cfg
    schedule, microbatches = ran
    return dataclasses.replace(cfg, choose="", schedule=schedule, microbatches=microbatches,
                               rows=max(1, cfg.batch // microbatches))
