"""The plan files committed under tests/golden/plans/: real plans of the examples, as
``pipecut.plan`` writes them, that tests/unit/test_schema.py validates with every other plan file
of the repository (a format change that would refuse plans already written fails there).

They are planned from counted costs (``MeasureOptions(estimate=...)``), so that regenerating
them gives the same splits on any machine; only the solver's run time and the versions change.
Regenerate (after a deliberate format change) with::

    python -m tests.golden_plans
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pipecut
from examples import gpt, mlp

__all__ = ["FOLDER", "PLANS", "write"]

FOLDER = Path(__file__).resolve().parent / "golden" / "plans"

_COUNTED = pipecut.MeasureOptions(estimate="A100-80GB")


def _gpt_1f1b() -> pipecut.Plan:
    """Tied embeddings across two stages, 1F1B, four microbatches."""
    model, inputs, loss_fn, target = gpt.build(batch_size=8, vocab=64, dim=32, heads=2, layers=2, seq=16)
    return pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=4, schedule="1f1b",
                        measure=_COUNTED)


def _mlp_auto() -> pipecut.Plan:
    """Three stages with microbatches and schedule chosen: the candidates recorded."""
    model, inputs, loss_fn, target = mlp.build(batch_size=8, width=16, depth=4)
    return pipecut.plan(model, inputs, 3, loss_fn=loss_fn, target=target, measure=_COUNTED)


PLANS: dict[str, Callable[[], pipecut.Plan]] = {"gpt_k2_1f1b_m4": _gpt_1f1b, "mlp_k3_auto": _mlp_auto}
"""File name (without ``.json``) -> how that plan is made."""


def write(folder: Path = FOLDER) -> list[Path]:
    """Plan every entry of :data:`PLANS` and write it to ``folder``; the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make in PLANS.items():
        path = folder / f"{name}.json"
        make().to_json(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write():
        print(p)
