"""``microbatches="auto"`` and ``schedule="auto"``: the planner picks them by predicted step time.

The graph is profiled at two microbatch sizes (the smallest and the largest candidate), node
times are modelled as affine in the microbatch size (:mod:`pipecut.passes.costs.microbatching`), and
every (microbatches, schedule) pair is partitioned and simulated on the interpolated costs.
Pairs whose plan does not fit memory, or that the runtime cannot run (zero-bubble or ZBV with
recompute), are ruled out; ZBV is among the candidates (it cuts 2K stages, two per rank, on a
V) unless several stages per rank were asked for. The winner is planned again for real
(profiled at its own size, calibrated) and the plan records every pair considered with its
prediction, so the choice is auditable. Within 1 % of the best time the pair that keeps fewer
activations alive wins (1F1B, then zero-bubble, then ZBV, then GPipe), then the one with fewer
microbatches.

Measuring is most of planning's time, so :class:`Measurements` does each piece once: the graph
is captured once and profiled at the second size too when it accepts that size (symbolic_trace
graphs take any; a torch.export graph, sizes within its symbolic ranges), and the winner's
plan reuses the graph and cost table measured at its size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipecut.capture.modes import describe_graph
from pipecut.core.batching import batch_size, first_microbatch, split_microbatches
from pipecut.core.kinds import CaptureMethod, ScheduleKind
from pipecut.core.program import Captured, Shapes
from pipecut.errors import InputError, PartitionError, PipecutError, ScheduleError
from pipecut.ir import NodeCost, Plan, ScheduleCandidate
from pipecut.options import AUTO
from pipecut.passes.costs.microbatching import candidate_microbatches, costs_at, with_structure
from pipecut.passes.partition.solve import as_schedule, partition_costs
from pipecut.planning.request import Request, capture_at, profile_at

__all__ = ["Measurements", "accepts", "choose_microbatches_and_schedule", "measurements", "plan_auto"]

PlanAt = Callable[[Request, Captured | None, Sequence[NodeCost] | None], Plan]
"""``(request at fixed microbatches and schedule, graph, cost table) -> plan``: the planner's
fixed plan, given what was captured and measured at that size already (or None)."""
_PREFERENCE = (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZERO_BUBBLE, ScheduleKind.ZBV,
               ScheduleKind.GPIPE, ScheduleKind.INTERLEAVED_1F1B)
_TIE = 0.01


def plan_auto(request: Request, plan_at: PlanAt) -> Plan:
    """Choose the microbatches and schedule the request leaves "auto" by predicted step, plan
    the winner for real on what was measured at its size, and record every pair considered."""
    measured = measurements(request)
    full, _ = first_microbatch(request.example_inputs, 1)
    tables: dict[int, Sequence[NodeCost]] = {}  # the table each microbatch count was planned on

    def partition_at(costs: Sequence[NodeCost], m: int, kind: ScheduleKind) -> Plan:
        tables[m] = costs
        return partition_costs(
            costs, devices=request.specs, microbatches=m, batch_size=full, schedule=kind,
            link=request.link, partition=request.options.partition, stages_per_rank=request.stages_per_rank,
            data_parallel=request.replication)

    options = request.options
    m, kind, candidates = choose_microbatches_and_schedule(
        request.example_inputs, request.target, ranks=len(request.specs), microbatches=options.microbatches
        if options.microbatches is not None else AUTO, schedule=options.schedule,
        stages_per_rank=request.stages_per_rank, profile_at=measured.costs, partition=partition_at,
    )
    first = first_microbatch(request.example_inputs, m)[1]
    graph, table = measured.at(first) or (None, None)
    if graph is not None and table is None:  # a size between those profiled, on their graph: its
        table = with_structure(tables[m], describe_graph(graph, graph.flatten_inputs(first)))  # interpolated table
    if graph is None and measured.timed_out:  # planned at its own size: no second wait either
        request = request.with_options(capture=dataclasses.replace(request.options.capture, dynamic_shapes=False))
    chosen = plan_at(request.with_options(microbatches=m, schedule=kind), graph, table)
    return dataclasses.replace(chosen, candidates=candidates)


def measurements(request: Request) -> Measurements:
    """Capture and profile the request's model at any microbatch size, each once. Once a
    symbolic-shape export has run past its time limit, the other sizes are exported at static
    shapes straight away (they would only wait as long again)."""
    static = request.with_options(capture=dataclasses.replace(request.options.capture, dynamic_shapes=False))
    measured = Measurements(
        lambda first: capture_at(static if measured.timed_out else request, first),
        lambda captured, first, first_target: profile_at(request, captured, first, first_target),
    )
    return measured


def schedules_to_try(schedule: Any, stages_per_rank: int) -> tuple[ScheduleKind, ...]:
    if schedule != AUTO:
        return (as_schedule(schedule),)
    if stages_per_rank > 1:
        return (ScheduleKind.INTERLEAVED_1F1B,)
    return (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZERO_BUBBLE, ScheduleKind.ZBV)


def choose_microbatches_and_schedule(
    example_inputs: Any,
    target: Any,
    *,
    ranks: int,
    microbatches: int | str,
    schedule: Any,
    stages_per_rank: int,
    profile_at: Callable[[Any, Any], Sequence[NodeCost]],
    partition: Callable[[Sequence[NodeCost], int, ScheduleKind], Plan],
) -> tuple[int, ScheduleKind, tuple[ScheduleCandidate, ...]]:
    """The chosen (microbatches, schedule) and every candidate with its prediction.

    ``profile_at(first_inputs, first_target)`` profiles one microbatch; ``partition(costs, m,
    kind)`` plans a cost table for M = m under ``kind``.
    """
    kinds = schedules_to_try(schedule, stages_per_rank)
    size, _ = first_microbatch(example_inputs, 1)
    counts = _counts(microbatches, kinds, size, ranks)
    costs_of = _cost_tables(example_inputs, target, size, counts, profile_at)
    return _pick([
        _candidate(kind, m, ranks, stages_per_rank, costs_of, partition)
        for kind in kinds
        for m in counts
    ])


def _counts(microbatches: int | str, kinds: Sequence[ScheduleKind], size: int, ranks: int) -> list[int]:
    """The microbatch counts to try: the one asked for, or with 'auto' every candidate count
    of every schedule tried."""
    if microbatches == AUTO:
        return sorted({m for k in kinds for m in candidate_microbatches(size, ranks, k)})
    if isinstance(microbatches, int) and not isinstance(microbatches, bool):
        return [microbatches]
    raise InputError(f"microbatches must be an int or 'auto', got {microbatches!r}")


def _cost_tables(
    example_inputs: Any,
    target: Any,
    size: int,
    counts: Sequence[int],
    profile_at: Callable[[Any, Any], Sequence[NodeCost]],
) -> Callable[[int], Sequence[NodeCost]]:
    """The cost table for M = m, for every m of ``counts``: the smallest and largest
    microbatches that run are profiled now, the others interpolated between them when the graph
    is the same at both sizes (else profiled when asked for). A count whose microbatch cannot be
    captured or run (BatchNorm in training on one sample) raises :class:`CannotRun` with the
    reason; where no count runs, a PartitionError lists them (or, where every count fails with
    the same pipecut error, that error)."""
    failed: dict[int, Exception] = {}

    def measure(m: int) -> Sequence[NodeCost]:
        if m in failed:
            raise CannotRun(m, size // m, failed[m])
        _, first = first_microbatch(example_inputs, m)
        first_target = split_microbatches(target, m, size, "target")[0] if target is not None else None
        try:
            return profile_at(first, first_target)
        except Exception as e:
            failed[m] = e
            raise CannotRun(m, size // m, e) from e

    def first_that_runs(order: Sequence[int]) -> tuple[int, Sequence[NodeCost]] | None:
        for m in order:
            try:
                return m, measure(m)
            except CannotRun:
                continue
        return None

    found = first_that_runs(sorted(counts, reverse=True))  # many microbatches = small ones first
    if found is None:
        raise _none_runs(size, failed)
    m_small, small = found
    # Every count beyond the two found has been tried and failed: interpolate between them only.
    m_large, large = first_that_runs([m for m in sorted(counts) if m < m_small]) or found
    same_graph = [n.name for n in small] == [n.name for n in large]

    def costs_of(m: int) -> Sequence[NodeCost]:
        if m in failed:
            raise CannotRun(m, size // m, failed[m])
        if same_graph:
            return costs_at(small, large, size // m_small, size // m_large, size // m)
        # the capture is shape-specialised and differs by size: measure this one
        return small if m == m_small else large if m == m_large else measure(m)

    return costs_of


class CannotRun(Exception):
    """A microbatch count whose microbatch the model cannot take (captured or run)."""

    def __init__(self, microbatches: int, samples: int, cause: Exception) -> None:
        self.microbatches, self.samples, self.cause = microbatches, samples, cause
        text = str(cause).strip().splitlines()
        super().__init__(f"microbatches of {samples} sample{'s' * (samples != 1)} cannot run: "
                         f"{type(cause).__name__}: {text[0][:150] if text else ''}")


def _none_runs(size: int, failed: dict[int, Exception]) -> Exception:
    """The error for a batch no candidate count can run."""
    causes = list(failed.values())
    if all(isinstance(c, PipecutError) and type(c) is type(causes[0]) and str(c) == str(causes[0]) for c in causes):
        return causes[0]  # the model's own problem, the same at every size: pipecut's error says it
    reasons = "; ".join(f"{m}: {CannotRun(m, size // m, e)}" for m, e in sorted(failed.items()))
    error = PartitionError(
        f"no microbatch count runs the model on this batch of {size}: {reasons}. Give a batch whose "
        f"microbatches the model can take (BatchNorm in training needs more than one sample each), "
        f"or fix the error above")
    error.__cause__ = causes[-1]
    return error


def _candidate(
    kind: ScheduleKind,
    m: int,
    ranks: int,
    stages_per_rank: int,
    costs_of: Callable[[int], Sequence[NodeCost]],
    partition: Callable[[Sequence[NodeCost], int, ScheduleKind], Plan],
) -> ScheduleCandidate:
    """``kind`` with M = m planned and predicted, or why it cannot run."""
    if kind is ScheduleKind.INTERLEAVED_1F1B and stages_per_rank > 1 and m % ranks:
        return ScheduleCandidate(  # with one stage per rank it is 1F1B: any count runs
            microbatches=m, schedule=kind, step_ms=None,
            note=f"{stages_per_rank} stages per rank need a multiple of the {ranks} ranks")
    try:
        costs = costs_of(m)
    except CannotRun as e:
        return ScheduleCandidate(microbatches=m, schedule=kind, step_ms=None, note=str(e)[:200])
    try:
        planned = partition(costs, m, kind)
    except (PartitionError, ScheduleError, InputError) as e:
        return ScheduleCandidate(microbatches=m, schedule=kind, step_ms=None, note=str(e)[:200])
    # Every schedule runs with replicas and recompute (on the torch versions pipecut supports:
    # pipecut.runtime.grads.data_parallel.check_supported), so none is ruled out for them here.
    return ScheduleCandidate(microbatches=m, schedule=kind, step_ms=planned.predicted.step_ms)


def _pick(candidates: Sequence[ScheduleCandidate]) -> tuple[int, ScheduleKind, tuple[ScheduleCandidate, ...]]:
    """The fastest candidate (within a tie margin, the preferred schedule, then the fewest
    microbatches), and every candidate with the chosen one marked."""
    feasible = [c for c in candidates if c.step_ms is not None]
    if not feasible:
        reasons = "; ".join(f"{c.microbatches}/{c.schedule.value}: {c.note}" for c in candidates[:4])
        raise PartitionError(f"no microbatch count and schedule fits: {reasons}")
    best = min(c.step_ms for c in feasible)  # type: ignore[type-var]
    near = [c for c in feasible if c.step_ms <= best * (1 + _TIE)]  # type: ignore[operator]
    pick = min(near, key=lambda c: (_PREFERENCE.index(c.schedule), c.microbatches))
    marked = tuple(dataclasses.replace(c, note="chosen") if c is pick else c for c in candidates)
    return pick.microbatches, pick.schedule, marked


def accepts(captured: Captured, flat_inputs: Sequence[Any]) -> bool:
    """Whether ``captured``'s graph computes the model on ``flat_inputs``, shapes that may differ
    from those it was captured with. symbolic_trace graphs are independent of the example; a
    torch.export graph accepts tensors of its placeholders' dtypes whose every dimension is
    either the captured constant or a symbol in its range, one size per symbol."""
    if captured.method is CaptureMethod.SYMBOLIC_TRACE:
        return True
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat_inputs):
        return False
    bound: dict[Any, int] = {}
    for node, x in zip(placeholders, flat_inputs):
        val = node.meta.get("val")
        if not isinstance(x, torch.Tensor) or not isinstance(val, torch.Tensor):
            if isinstance(x, torch.Tensor) or isinstance(val, torch.Tensor) or x != val:
                return False
            continue
        if val.dtype != x.dtype or val.dim() != x.dim():
            return False
        for d, size in zip(val.shape, x.shape):
            if not isinstance(d, torch.SymInt):
                if d != size:
                    return False
                continue
            expr = d.node.expr
            if expr.is_number:  # a symbol export specialised to a constant
                if int(expr) != size:
                    return False
                continue
            ranges = d.node.shape_env.var_to_range.get(expr) if expr.is_Symbol else None
            if ranges is None or not ranges.lower <= size <= ranges.upper or bound.setdefault(expr, size) != size:
                return False
    return True


class Measurements:
    """Captures and cost tables of one ``plan(..., microbatches="auto")`` call, by microbatch
    size. ``capture_at(first)`` captures on one microbatch, ``profile_on(captured, first,
    first_target)`` profiles it; each is called as rarely as correctness allows."""

    def __init__(
        self,
        capture_at: Callable[[Any], Captured],
        profile_on: Callable[[Captured, Any, Any], Sequence[NodeCost]],
    ) -> None:
        self._capture_at = capture_at
        self._profile_on = profile_on
        self._graphs: dict[int, Captured] = {}  # by the microbatch size captured at
        self._tables: dict[int, tuple[Captured, tuple[NodeCost, ...]]] = {}
        self.captures = 0
        self.profiles = 0
        self.timed_out = False
        """Whether a symbolic-shape export ran past its time limit (see :func:`measurements`)."""

    def _capture(self, first: Any, size: int) -> Captured:
        self.captures += 1
        self._graphs[size] = self._capture_at(first)
        self.timed_out |= self._graphs[size].shapes is Shapes.TIMED_OUT
        return self._graphs[size]

    def costs(self, first: Any, first_target: Any) -> tuple[NodeCost, ...]:
        """The cost table at ``first``'s size, on a graph already captured if one accepts it."""
        size = _size(first)
        captured = self._graphs.get(size) or next(
            (c for c in self._graphs.values() if accepts(c, c.flatten_inputs(first))), None
        )
        if captured is None:
            captured = self._capture(first, size)
        self.profiles += 1
        try:
            nodes = tuple(self._profile_on(captured, first, first_target))
        except Exception:
            if captured is self._graphs.get(size):
                raise
            captured = self._capture(first, size)  # the other size's graph did not fit after all
            nodes = tuple(self._profile_on(captured, first, first_target))
        self._tables[size] = (captured, nodes)
        return nodes

    def at(self, first: Any) -> tuple[Captured, tuple[NodeCost, ...] | None] | None:
        """For planning the winner at ``first``'s size: a graph that computes it and the cost
        table measured at that size (None: profile again, on that graph), or None if no graph
        captured so far accepts that size. A torch.export graph is not captured again at the
        winner's size: where it accepts a size, its dimensions stayed symbolic, and it is the
        very graph (same fingerprint) an export at that size gives, which ``compile`` checks."""
        size = _size(first)
        if size in self._tables:
            return self._tables[size]
        graph = self._graphs.get(size) or next(
            (c for c in self._graphs.values() if accepts(c, c.flatten_inputs(first))), None
        )
        return (graph, None) if graph is not None else None


def _size(first: Any) -> int:
    return batch_size(list(first.values()) if isinstance(first, dict) else list(first))
