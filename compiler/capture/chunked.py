"""The graph a plan runs: the captured graph with the plan's heavy nodes computed in row pieces.

A plan with ``chunked`` nodes (see :mod:`pipecut.passes.rewrite.chunk_rows`) was partitioned on the
rewritten graph, while its fingerprint is the captured one's, so that a plan is checked against
the model as captured. Every path that splits a captured graph into stages (compile, the
other train/eval mode, calibration, live re-planning) goes through :func:`as_planned` after the
fingerprint check, and so sees the very graph the plan's stages name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pipecut.core.program import Captured
from pipecut.ir import ChunkedNode
from pipecut.passes.rewrite.chunk_rows import chunk_rows

__all__ = ["as_planned"]


def as_planned(captured: Captured, chunked: Sequence[ChunkedNode]) -> Captured:
    """``captured`` with its graph rewritten as ``chunked`` says (the same object when nothing
    is chunked). The rewritten graph shares the captured graph's parameters and buffers."""
    if not chunked:
        return captured
    return dataclasses.replace(captured, gm=chunk_rows(captured.gm, chunked))
