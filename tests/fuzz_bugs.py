"""Bugs the differential fuzzer knows about and that are still open: which configurations hit
each one, so that the fixed budget (tests/dist/test_fuzz.py) leaves them out and a campaign
(benchmarks/fuzz.py) can tell a known failure from a new one.

Each entry says which configurations hit the bug, as narrowly as the shrunk repros allow (a
wide predicate hides new bugs behind a known one). Every entry has a strict xfail in
tests/dist/test_fuzz_regressions.py with its shrunk configuration: when a fix lands, that test
XPASSes, and the entry and the mark go together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tests.fuzz_config import SPLIT_BACKWARD, Config
from tests.fuzz_models import MODELS


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KnownBug:
    what: str
    """The symptom and, where known, the cause and who is fixing it."""
    found: str = "reported"
    """``reported`` (known before this fuzzer's campaign found it) or ``fuzzer`` (found by it)."""
    hits: Callable[[Config], bool]
    """Whether a configuration runs into it."""


SPLIT_BACKWARD_MODELS = ("t5", "bart", "albert", "vit", "swin")
"""The families the split-backward bug was reported on (Swin as ViT-like). The hand-written
models match under zero-bubble and ZBV with one-sample microbatches, their learned position
embedding added to an activation of its shape included (tied_lm, rows=1)."""


def _split_backward(cfg: Config) -> bool:
    """Runs zero-bubble or ZBV, or lets compile choose the schedule."""
    return cfg.schedule in SPLIT_BACKWARD or cfg.choose == "both"


KNOWN: dict[str, KnownBug] = {
    "split-backward": KnownBug(
        what="zero-bubble/ZBV give wrong gradients where a parameter is added to an activation of its "
             "own shape (T5, BART, ALBERT, ViT-like models; one-sample microbatches): "
             "runtime/backward_split.py, being fixed on branch zb",
        hits=lambda c: _split_backward(c) and c.model in SPLIT_BACKWARD_MODELS),
    "float64-loss": KnownBug(
        what="float64 parameters: the loss returned on ranks other than the last is rounded to float32 "
             "(float32 default dtype) or garbage such as 5.3e-315 (float64 default dtype)",
        hits=lambda c: c.dtype == "float64"),
    "ddp-freeze": KnownBug(
        what="a parameter frozen after compile under DDP: the second step crashes and the first step's "
             "gradients are not averaged",
        hits=lambda c: c.data_parallel == "ddp" and c.freezes),
    "swin-export": KnownBug(
        what="transformers Swin at one-sample microbatches hangs in torch.export; the fuzzer saw it at "
             "microbatches of 2 and 3 samples too (over 10 min in sympy under window_reverse's view, "
             "capture/trace.py _export, planning at the first microbatch's size)",
        hits=lambda c: c.model == "swin"),
    "fsdp-eval-stale": KnownBug(
        what="FSDP: after an optimizer step, pipe.eval() of a torch.export model runs on the weights of "
             "compile time (compiler/capture/modes.py shares parameters with the training programs before "
             "runtime/data_parallel.replicate's fully_shard replaces them)",
        found="fuzzer", hits=lambda c: c.data_parallel == "fsdp" and c.eval_between and MODELS[c.model].real),
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
