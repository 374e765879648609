"""Every stage holds a parameter: a constraint of every partitioner, and the stage count it allows.

A stage without parameters cannot train with the README's loop: on its rank
``torch.optim.AdamW(pipe.parameters())`` raises "optimizer got an empty parameter list". So when
the model has parameters, each solver (the reference DP of ``tests/exact_dp.py``, the bounded DP
of :mod:`pipecut.passes.partition.memory_dp` and the ILP of :mod:`pipecut.passes.partition.ilp`) only takes splits in
which every stage holds at least one unit that reads a parameter (a tied weight counts on every
stage that reads it). :func:`max_stages` says how many stages a chain allows, and
:func:`stage_count_error` turns "too many" into an error that says so. Pure numbers, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipecut.errors import PartitionError
from pipecut.ir import NodeCost
from pipecut.passes.partition.chain import reads_params

__all__ = ["holder_prefix", "holds_params", "max_stages", "stage_count_error"]


def holds_params(nodes: Sequence[NodeCost], units: Sequence[str]) -> tuple[bool, ...]:
    """Per unit: does it read a parameter, directly (a module's own) or through a ``get_attr``?"""
    by_name = {n.name: n for n in nodes}
    return tuple(reads_params(by_name[u], by_name) for u in units)


def holder_prefix(holds: Sequence[bool], units: int) -> np.ndarray:
    """Prefix counts of parameter-holding units (N + 1 entries). With no constraint (``holds``
    empty, or a model without parameters) every unit counts, so a stage only needs to be
    non-empty, which every solver requires anyway."""
    flags = np.asarray(holds, dtype=np.int64) if any(holds) else np.ones(units, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(flags)])


def max_stages(holds: Sequence[bool], positions: Sequence[int]) -> int:
    """The most stages a split at the cut ``positions`` (1..N-1) can have, each holding a
    parameter. Cutting as early as possible maximises the count (an exchange argument); a
    trailing piece without parameters joins the stage before it. 0 if no unit holds one."""
    allowed = set(positions)
    count, seen = 0, False
    for b, h in enumerate(holds):
        if b in allowed and seen:
            count, seen = count + 1, False
        seen = seen or h
    return count + 1 if seen else count


def stage_count_error(stages: int, holds: Sequence[bool], positions: Sequence[int]) -> PartitionError | None:
    """The error for asking more stages than can each hold a parameter; None if the count is
    possible or the model has no parameters (then there is nothing to train, nor to check)."""
    if not any(holds):
        return None
    most = max_stages(holds, positions)
    if stages <= most:
        return None
    return PartitionError(
        f"this model supports at most {most} pipeline stages with parameters on every stage "
        f"({sum(holds)} of its {len(holds)} partitionable nodes read parameters), but "
        f"{stages} stages were asked for; a stage without parameters cannot train "
        f"(torch.optim.AdamW(pipe.parameters()) raises 'empty parameter list' on its rank). "
        f"Use at most {most} devices (stages_per_rank x devices <= {most})"
    )
