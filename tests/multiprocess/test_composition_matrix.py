"""The fixed subset of issue 42's composition matrix that ``make test`` runs.

The whole matrix (schedule × replicas × T × recompute × stages, on the GPT example and the
transformers Llama) is ``benchmarks/composition_matrix.py``; its cells are defined once there
(:func:`benchmarks.composition_matrix.column`) and run here by the same runner
(``benchmarks/zoo_matrix.py``: each cell on its own forked gloo ranks, one training step, loss,
gradients and buffers against the plain model, with its tolerances). The subset takes one cell of
each composition the runtime refused before issue 42, on both models where it runs in seconds:
zero-bubble and ZBV with DDP or FSDP2 replicas, with tensor-parallel stages, with selective
recompute, and compiled, compiled stages with T = 2 among them (the last refusal, lifted on
2026-12-07: the Llama's vocabulary-split embedding and its views are what failed), and all of
them at once (ZBV, FSDP2, T = 2, selective recompute, compiled: 8 ranks).
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.composition_matrix import column
from benchmarks.zoo_matrix import sweep

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1500)]  # the first test builds every cell, cold inductor compiles among them

CELLS = (  # (model, schedule, replicas, T, recompute, stages) -> the status it must have
    (("gpt", "zero-bubble", "ddp", 1, "selective", "eager"), "pass"),
    (("gpt", "zbv", "fsdp", 1, "selective", "eager"), "pass"),
    (("gpt", "zero-bubble", "none", 2, "selective", "eager"), "pass"),
    (("gpt", "zbv", "ddp", 1, "none", "compiled"), "pass"),
    (("gpt", "zero-bubble", "none", 2, "none", "compiled"), "pass"),
    (("gpt", "zbv", "fsdp", 2, "selective", "compiled"), "pass"),
    (("llama", "1f1b", "none", 2, "none", "compiled"), "pass"),
    (("llama", "zbv", "ddp", 1, "selective", "eager"), "pass"),
    (("llama", "zero-bubble", "fsdp", 1, "none", "eager"), "pass"),
    (("llama", "zero-bubble", "none", 2, "selective", "eager"), "pass"),
)


@pytest.fixture(scope="module")
def rows() -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for cell, _ in CELLS:
        model, *dims = cell
        (row,) = sweep([model], [column(*dims)], [2], timeout=600, measured=False)
        out[cell] = row
    return out


@pytest.mark.parametrize("cell, status", CELLS, ids=["/".join(map(str, c)) for c, _ in CELLS])
def test_the_cell_is_at_parity_or_refused_with_its_reason(rows: dict[tuple[Any, ...], dict[str, Any]],
                                                          cell: tuple[Any, ...], status: str) -> None:
    row = rows[cell]
    assert row["status"] == status, f"{'/'.join(map(str, cell))}: {row['status']}: {row.get('detail', '')}"
