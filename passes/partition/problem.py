"""The partitioning problem: built from a cost table (:func:`formulate`), and its exact cost model.

A chain of N units (topological order) is cut into K contiguous stages; stage ``s`` runs on
device ``s`` and holds units ``[i, j)``. Its time per microbatch and its peak memory are

    time_s   = compute[i:j] / speed_s + boundary_ms[i] + boundary_ms[j]   (+ forward[i:j] / speed_s
                                                                           again if it recomputes)
    memory_s = fixed[i:j] + inflight_s * (input_bytes[i] + activation[i:j])   (no recompute)
             = fixed[i:j] + inflight_s *  input_bytes[i]                      (recompute: only the
                                                                           stage inputs are kept)

Between the two, a stage may recompute some of its blocks (``Recompute.SELECTIVE``): the
stretches between the ``block_cuts`` inside it (module boundaries: transformer layers, their
attention and MLP). Recomputing block ``[a, e)`` frees ``activation[a:e]`` but keeps its inputs
(``input_bytes[a]``, counted again to stay on the safe side) and costs ``forward[a:e]`` again.
Where a stage does not fit without recompute, its selective option recomputes the blocks that
free the most bytes per millisecond first, until it fits; if that takes every block, the whole
stage recomputes instead (the same time for less memory).

which is the model of :func:`pipecut.passes.costs.stages.build_stages`. Every solver (DP, ILP,
baselines, brute force) is judged by :func:`evaluate`, so they can be compared number for number.
No torch here: tests build problems by hand.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipecut.cluster import Link
from pipecut.core.kinds import Recompute, ScheduleKind
from pipecut.ir import DeviceSpec, NodeCost
from pipecut.options import DataParallelOptions
from pipecut.passes.costs.stages import inflight_microbatches, state_bytes
from pipecut.passes.partition.chain import (
    Liveness,
    boundary_bytes,
    boundary_messages,
    boundary_ms,
    liveness,
    unit_param_bytes,
)
from pipecut.passes.partition.coarsen import block_cuts
from pipecut.passes.partition.holders import holds_params

__all__ = [
    "Evaluation",
    "Formulation",
    "Problem",
    "StageEval",
    "best_stage",
    "evaluate",
    "formulate",
    "stage_options",
    "unit_fixed_bytes",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """Cut N units into K stages; per-unit arrays have N entries, per-cut arrays N + 1."""

    compute_ms: tuple[float, ...]
    """Forward + backward time of each unit on a speed-1 device."""
    forward_ms: tuple[float, ...]
    """Forward time of each unit: paid again in backward by a stage that recomputes."""
    boundary_ms: tuple[float, ...]
    """Communication time of a cut before unit b (inf where a live value cannot cross)."""
    input_bytes: tuple[int, ...]
    """Activation bytes live across the cut before unit b: what a stage starting there receives."""
    fixed_bytes: tuple[int, ...]
    """Parameter, gradient and optimizer-state bytes of each unit."""
    activation_bytes: tuple[int, ...]
    """Bytes of each unit's output kept per microbatch until its backward."""
    speeds: tuple[float, ...]
    """Relative speed of the device of each stage (K entries)."""
    capacities: tuple[float | None, ...]
    """Memory capacity of each stage's device; None is unlimited."""
    inflight: tuple[int, ...]
    """Microbatches whose activations each stage holds at its peak (set by the schedule)."""
    recompute: bool = False
    """Whether a stage may recompute its forward in backward to keep only its inputs."""
    block_cuts: tuple[int, ...] = ()
    """Sorted cut positions where a block starts: a stage that may recompute may recompute some
    of its blocks only (empty: only the whole stage)."""
    names: tuple[str, ...] = ()
    holds_params: tuple[bool, ...] = ()
    """Per unit: reads a parameter. When given (and some unit does), a stage fits only if it
    holds one such unit (:mod:`pipecut.passes.partition.holders`): otherwise its rank has nothing to train."""

    def __post_init__(self) -> None:
        n, k = len(self.compute_ms), len(self.speeds)
        per_unit = (self.forward_ms, self.fixed_bytes, self.activation_bytes)
        if any(len(a) != n for a in per_unit) or any(
            a and len(a) != n for a in (self.names, self.holds_params)
        ):
            raise ValueError(f"a problem of {n} units needs {n} entries in every per-unit array")
        if len(self.boundary_ms) != n + 1 or len(self.input_bytes) != n + 1:
            raise ValueError(f"a problem of {n} units needs {n + 1} entries per cut array")
        if len(self.capacities) != k or len(self.inflight) != k:
            raise ValueError(f"{k} stages need {k} capacities and {k} inflight counts")
        if k < 1:
            raise ValueError("a problem needs at least one stage")
        if list(self.block_cuts) != sorted(set(self.block_cuts)) or any(not 0 < b < n for b in self.block_cuts):
            raise ValueError(f"block cuts {self.block_cuts[:5]}... must be sorted positions in 1..{n - 1}")

    @property
    def units(self) -> int:
        return len(self.compute_ms)

    @property
    def stages(self) -> int:
        return len(self.speeds)

    @property
    def constrained(self) -> bool:
        """True when the plain DP does not apply: memory limits, recompute or unequal speeds."""
        return (
            self.recompute
            or any(c is not None for c in self.capacities)
            or len(set(self.speeds)) > 1
        )

    def allowed_cuts(self) -> tuple[int, ...]:
        """Cut positions 1..N-1 where every live value can cross."""
        return tuple(b for b in range(1, self.units) if math.isfinite(self.boundary_ms[b]))


@dataclass(frozen=True, kw_only=True, slots=True)
class StageEval:
    time_ms: float
    memory_bytes: float
    recompute: Recompute
    fits: bool
    """Within the device's memory and, where the problem asks, holding a parameter."""
    recomputed: tuple[tuple[int, int], ...] = ()
    """``Recompute.SELECTIVE``: the blocks ``[a, e)`` (unit positions) that recompute."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    bounds: tuple[int, ...]
    stages: tuple[StageEval, ...]

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def bottleneck_ms(self) -> float:
        return max(s.time_ms for s in self.stages)

    @property
    def stage_ms(self) -> tuple[float, ...]:
        return tuple(s.time_ms for s in self.stages)

    @property
    def recompute(self) -> tuple[Recompute, ...]:
        return tuple(s.recompute for s in self.stages)


def stage_options(problem: Problem, s: int, i: int, j: int) -> list[StageEval]:
    """The ways stage ``s`` can run units ``[i, j)``, by decreasing memory: without recompute,
    recomputing some blocks (where it does not fit without), recomputing all (if allowed)."""
    p = problem
    speed = p.speeds[s]
    comm = p.boundary_ms[i] + p.boundary_ms[j]
    base = math.fsum(p.compute_ms[i:j]) / speed + comm
    fixed = sum(p.fixed_bytes[i:j])
    kept = p.input_bytes[i] + sum(p.activation_bytes[i:j])
    cap = p.capacities[s]
    holds = not any(p.holds_params) or any(p.holds_params[i:j])

    def option(time: float, mem: float, rc: Recompute, blocks: tuple[tuple[int, int], ...] = ()) -> StageEval:
        return StageEval(time_ms=time, memory_bytes=mem, recompute=rc, recomputed=blocks,
                         fits=(cap is None or mem <= cap) and holds)

    options = [option(base, fixed + p.inflight[s] * kept, Recompute.NONE)]
    if not p.recompute:
        return options
    if cap is not None and not options[0].fits and p.block_cuts:
        some = _selective(p, s, i, j, need=(fixed + p.inflight[s] * kept - cap) / p.inflight[s])
        if some is not None:
            extra_ms, freed, blocks = some
            options.append(option(base + extra_ms / speed, fixed + p.inflight[s] * (kept - freed),
                                  Recompute.SELECTIVE, blocks))
    options.append(option(base + math.fsum(p.forward_ms[i:j]) / speed,
                          fixed + p.inflight[s] * p.input_bytes[i], Recompute.FULL))
    return options


def _selective(
    p: Problem, s: int, i: int, j: int, need: float
) -> tuple[float, int, tuple[tuple[int, int], ...]] | None:
    """The blocks of ``[i, j)`` to recompute to free ``need`` bytes per microbatch, cheapest
    time per byte first: (forward ms recomputed, bytes freed, blocks); None if it takes all."""
    lo, hi = bisect.bisect_right(p.block_cuts, i), bisect.bisect_left(p.block_cuts, j)
    edges = (i, *p.block_cuts[lo:hi], j)
    blocks = []
    for a, e in itertools.pairwise(edges):
        freed = sum(p.activation_bytes[a:e]) - (p.input_bytes[a] if a > i else 0)
        if freed > 0:
            blocks.append((math.fsum(p.forward_ms[a:e]) / freed, freed, a, e))
    blocks.sort()
    total_ms, total, chosen = 0.0, 0, []
    for _, freed, a, e in blocks:
        if total >= need:
            break
        chosen.append((a, e))
        total += freed
        total_ms += math.fsum(p.forward_ms[a:e])
    if total < need or len(chosen) == len(edges) - 1:
        return None
    return total_ms, total, tuple(sorted(chosen))


def best_stage(problem: Problem, s: int, i: int, j: int) -> StageEval:
    """The fastest option that fits; if none fits, the one that needs the least memory."""
    options = stage_options(problem, s, i, j)
    fitting = [o for o in options if o.fits]
    if fitting:
        return min(fitting, key=lambda o: o.time_ms)
    return min(options, key=lambda o: o.memory_bytes)


def evaluate(
    problem: Problem, bounds: Sequence[int], recompute: Sequence[Recompute] | None = None
) -> Evaluation:
    """Score a split; with ``recompute`` None each stage takes its fastest option that fits."""
    k = len(bounds) - 1
    if k != problem.stages or bounds[0] != 0 or bounds[-1] != problem.units:
        raise ValueError(
            f"bounds {tuple(bounds)} must run from 0 to {problem.units} in {problem.stages} stages"
        )
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"bounds {tuple(bounds)} must increase strictly (no empty stage)")
    stages = []
    for s in range(k):
        i, j = bounds[s], bounds[s + 1]
        if recompute is None:
            stages.append(best_stage(problem, s, i, j))
        else:
            opts = {o.recompute: o for o in stage_options(problem, s, i, j)}  # SELECTIVE: its blocks
            if recompute[s] not in opts:
                raise ValueError(f"stage {s}: recompute {recompute[s].value} is not allowed")
            stages.append(opts[recompute[s]])
    return Evaluation(bounds=tuple(bounds), stages=tuple(stages))


# --- from a cost table to a Problem over the unit chain ----------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Formulation:
    problem: Problem
    live: Liveness
    modules: tuple[str, ...]
    """Module path of each unit, for coarsening at module boundaries."""


def unit_fixed_bytes(node: NodeCost, by_name: dict[str, NodeCost], data_parallel: DataParallelOptions | None = None) -> int:
    """Parameters, gradients and optimizer state of a unit and the ``get_attr`` nodes it reads.

    A parameter read by two units of one stage is counted twice here (once in the plan), so the
    memory the solvers see is never below what the plan reports.
    """
    return state_bytes(unit_param_bytes(node, by_name), data_parallel)


def formulate(
    nodes: Sequence[NodeCost],
    *,
    devices: Sequence[DeviceSpec],
    link: Link,
    schedule: ScheduleKind,
    microbatches: int,
    recompute: bool,
    data_parallel: DataParallelOptions | None = None,
) -> Formulation:
    live = liveness(nodes)
    fwd_bytes, bwd_bytes, allowed = boundary_bytes(nodes, live)
    by_name = {n.name: n for n in nodes}
    units = [by_name[u] for u in live.units]
    k = len(devices)
    problem = Problem(
        names=live.units,
        compute_ms=tuple(u.forward_ms + u.backward_ms for u in units),
        forward_ms=tuple(u.forward_ms for u in units),
        boundary_ms=tuple(boundary_ms(fwd_bytes, bwd_bytes, allowed, link, boundary_messages(nodes, live))),
        input_bytes=tuple(fwd_bytes),
        fixed_bytes=tuple(unit_fixed_bytes(u, by_name, data_parallel) for u in units),
        activation_bytes=tuple(u.kept_bytes for u in units),
        speeds=tuple(d.speed for d in devices),
        capacities=tuple(d.memory_bytes for d in devices),
        inflight=tuple(inflight_microbatches(schedule, k, microbatches)),
        recompute=recompute,
        block_cuts=block_cuts([u.module for u in units], [b for b in range(1, len(units)) if allowed[b]])
        if recompute else (),
        holds_params=holds_params(nodes, live.units),
    )
    return Formulation(problem=problem, live=live, modules=tuple(u.module for u in units))
