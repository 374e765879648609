"""Splits people choose: module names per stage, or the modules where new stages begin.

Large users want manual control (torchtitan's ``module_fqns_per_model_part``, Megatron's layout
strings). Both forms become the same thing the partitioners produce: ``bounds``, K + 1
increasing unit indices, stage ``s`` holding units ``[bounds[s], bounds[s+1])``. The plan is then
built from those bounds exactly as from the partitioner's, so its predicted cost can be shown
beside pipecut's own optimum.

A unit belongs to the stage that lists the longest module path containing the unit's module
(``blocks`` in stage 0 and ``blocks.3`` in stage 1 put ``blocks.3.mlp`` in stage 1). Units in no
listed module (a top-level residual add, the output node) stay in the stage of the unit before
them. The assignment must be contiguous in the graph's topological order; otherwise the error
names the first unit that breaks it.

    >>> bounds_from_modules(units, [["emb", "blocks.0"], ["blocks.1", "head"]])
    (0, 41, 87)
    >>> bounds_from_split_points(units, ["blocks.1"])
    (0, 41, 87)
"""

from __future__ import annotations

from collections.abc import Sequence

from pipecut.errors import PartitionError
from pipecut.ir import NodeCost

__all__ = ["bounds_from_modules", "bounds_from_split_points", "is_split_points"]


def _within(module: str, fqn: str) -> bool:
    return module == fqn or module.startswith(fqn + ".")


def _known(units: Sequence[NodeCost]) -> str:
    tops = sorted({u.module.split(".")[0] for u in units if u.module})
    return ", ".join(tops[:12]) + (" …" if len(tops) > 12 else "")


def is_split_points(split: Sequence[str] | Sequence[Sequence[str]]) -> bool:
    """True for split points (a list of module names), False for modules per stage."""
    return all(isinstance(s, str) for s in split)


def bounds_from_modules(units: Sequence[NodeCost], modules_per_stage: Sequence[Sequence[str]]) -> tuple[int, ...]:
    """Bounds for a split given as module FQNs per stage (every stage lists at least one)."""
    owner: dict[str, int] = {}
    for s, fqns in enumerate(modules_per_stage):
        if not fqns:
            raise PartitionError(f"stage {s} of the given split lists no module; every stage needs one")
        for fqn in fqns:
            if fqn in owner:
                raise PartitionError(f"module {fqn!r} is listed for stages {owner[fqn]} and {s}")
            owner[fqn] = s
    matched: set[str] = set()
    stage_of: list[int] = []
    for u in units:
        best = max((f for f in owner if _within(u.module, f)), key=len, default=None)
        if best is None:
            stage_of.append(stage_of[-1] if stage_of else 0)
            continue
        matched.add(best)
        s = owner[best]
        if stage_of and s < stage_of[-1]:
            raise PartitionError(
                f"the given split is not contiguous: node {u.name} (module {u.module!r}) is in "
                f"stage {s} but comes after a node of stage {stage_of[-1]}; list modules in "
                f"execution order, each stage's modules after the previous stage's"
            )
        stage_of.append(s)
    unmatched = [f for f in owner if f not in matched]
    if unmatched:
        raise PartitionError(
            f"the given split names module(s) {unmatched} with no node in the captured graph "
            f"(top-level modules: {_known(units)})"
        )
    return _bounds(stage_of, len(modules_per_stage))


def bounds_from_split_points(units: Sequence[NodeCost], points: Sequence[str]) -> tuple[int, ...]:
    """Bounds for K - 1 split points: stage s + 1 begins at the first node of ``points[s]``."""
    starts = [0]
    for fqn in points:
        first = next((i for i, u in enumerate(units) if _within(u.module, fqn)), None)
        if first is None:
            raise PartitionError(
                f"split point {fqn!r} names no module of the captured graph (top-level "
                f"modules: {_known(units)})"
            )
        if first <= starts[-1]:
            raise PartitionError(
                f"split point {fqn!r} starts at node {units[first].name}, not after the "
                f"previous stage's start; give split points in execution order"
            )
        starts.append(first)
    return (*starts, len(units))


def _bounds(stage_of: Sequence[int], stages: int) -> tuple[int, ...]:
    starts = [next((i for i, t in enumerate(stage_of) if t >= s), len(stage_of)) for s in range(stages)]
    bounds = (0, *starts[1:], len(stage_of))
    for s in range(stages):
        if bounds[s] >= bounds[s + 1]:
            raise PartitionError(f"stage {s} of the given split holds no node")
    return bounds
