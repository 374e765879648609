"""``pipecut diff a.json b.json``: which nodes moved between stages, and what it does to the prediction.

:func:`diff_plans` is pure (two plans in, a :class:`PlanDiff` out); :func:`format_diff` prints it.
Moves are grouped by module and by (from stage, to stage) so that a shifted cut in a large model
reads as one line ("blocks.3: 41 nodes 1 → 2"), not forty-one.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipecut.ir import Plan
from pipecut.report.text import human_bytes

__all__ = ["Move", "PlanDiff", "StageDelta", "diff_plans", "format_diff"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    """A run of consecutive nodes (topological order) that went from one stage to another."""

    module: str
    """The deepest module holding every node of the run (or the outermost modules it spans)."""
    src_stage: int | None
    """None when the node is not in the first plan."""
    dst_stage: int | None
    """None when the node is not in the second plan."""
    nodes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageDelta:
    index: int
    time_ms: tuple[float | None, float | None]
    peak_memory_bytes: tuple[int | None, int | None]
    send_bytes: tuple[int | None, int | None]
    nodes: tuple[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanDiff:
    same_graph: bool
    settings: tuple[tuple[str, str, str], ...]
    """(setting, in a, in b) for schedule, microbatches, stages, devices that differ."""
    moves: tuple[Move, ...]
    stages: tuple[StageDelta, ...]
    step_ms: tuple[float, float]
    bubble_fraction: tuple[float, float]
    bottleneck_stage: tuple[int, int]

    @property
    def moved_nodes(self) -> int:
        return sum(len(m.nodes) for m in self.moves)


def _settings(a: Plan, b: Plan) -> tuple[tuple[str, str, str], ...]:
    pairs = {
        "schedule": (a.schedule.value, b.schedule.value),
        "microbatches": (str(a.microbatches), str(b.microbatches)),
        "batch size": (str(a.batch_size), str(b.batch_size)),
        "stages": (str(a.num_stages), str(b.num_stages)),
        "devices": (", ".join(f"{d.name}/{human_bytes(d.memory_bytes) if d.memory_bytes else '∞'}/x{d.speed:g}" for d in a.devices),
                    ", ".join(f"{d.name}/{human_bytes(d.memory_bytes) if d.memory_bytes else '∞'}/x{d.speed:g}" for d in b.devices)),
        "partitioner": (a.solver.method.value, b.solver.method.value),
    }
    return tuple((k, x, y) for k, (x, y) in pairs.items() if x != y)


def _common_module(modules: list[str]) -> str:
    """The deepest module path shared by all, else the distinct outermost modules."""
    parts = [m.split(".") if m else [] for m in modules]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    if common or len(set(modules)) == 1:
        return ".".join(common)
    tops = dict.fromkeys(p[0] if p else "(top level)" for p in parts)
    return ", ".join(tops)


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Compare two plans of (normally) the same model."""
    sa, sb = a.stage_of(), b.stage_of()
    module = {n.name: n.module for n in a.nodes} | {n.name: n.module for n in b.nodes}
    order = [n.name for n in a.nodes] + [n.name for n in b.nodes if n.name not in sa]
    runs: list[tuple[int | None, int | None, list[str]]] = []
    previous: str | None = None
    for name in order:
        if name not in sa and name not in sb:
            continue  # placeholders and parameters are on every stage that uses them
        src, dst = sa.get(name), sb.get(name)
        if src != dst:
            if runs and runs[-1][:2] == (src, dst) and runs[-1][2][-1] == previous:
                runs[-1][2].append(name)
            else:
                runs.append((src, dst, [name]))
        previous = name
    moves = tuple(Move(module=_common_module([module.get(n, "") for n in ns]), src_stage=s,
                       dst_stage=d, nodes=tuple(ns)) for s, d, ns in runs)

    def get(plan: Plan, i: int, attr: str):  # type: ignore[no-untyped-def]
        return getattr(plan.stages[i], attr) if i < plan.num_stages else None

    stages = tuple(
        StageDelta(
            index=i,
            time_ms=(get(a, i, "time_ms"), get(b, i, "time_ms")),
            peak_memory_bytes=(get(a, i, "peak_memory_bytes"), get(b, i, "peak_memory_bytes")),
            send_bytes=(get(a, i, "send_bytes"), get(b, i, "send_bytes")),
            nodes=(len(get(a, i, "nodes") or ()), len(get(b, i, "nodes") or ())),
        )
        for i in range(max(a.num_stages, b.num_stages))
    )
    return PlanDiff(
        same_graph=a.fingerprint == b.fingerprint,
        settings=_settings(a, b),
        moves=moves,
        stages=stages,
        step_ms=(a.predicted.step_ms, b.predicted.step_ms),
        bubble_fraction=(a.predicted.bubble_fraction, b.predicted.bubble_fraction),
        bottleneck_stage=(a.predicted.bottleneck_stage, b.predicted.bottleneck_stage),
    )


def _change(x: float | None, y: float | None, fmt) -> str:  # type: ignore[no-untyped-def]
    if x is None or y is None:
        return f"{'—' if x is None else fmt(x)} → {'—' if y is None else fmt(y)}"
    if x == y:
        return f"{fmt(x)} (same)"
    pct = f" ({(y - x) / x:+.1%})" if x else ""
    return f"{fmt(x)} → {fmt(y)}{pct}"


def _stage(s: int | None) -> str:
    return "—" if s is None else str(s)


def format_diff(d: PlanDiff, names: tuple[str, str] = ("a", "b"), max_nodes: int = 6) -> str:
    """The diff as text: settings, moved nodes by module, per-stage and predicted changes."""
    lines = []
    if not d.same_graph:
        lines.append(f"warning: {names[0]} and {names[1]} are plans of different graphs "
                     f"(fingerprints differ); node moves compare nodes by name")
    for key, x, y in d.settings:
        lines.append(f"{key}: {x} → {y}")
    if d.moves:
        lines.append(f"{d.moved_nodes} node(s) moved between stages:")
        for m in d.moves:
            shown = ", ".join(m.nodes[:max_nodes]) + (f", … (+{len(m.nodes) - max_nodes})" if len(m.nodes) > max_nodes else "")
            lines.append(f"  {m.module or '(top level)'}: {len(m.nodes)} node(s) stage "
                         f"{_stage(m.src_stage)} → {_stage(m.dst_stage)}: {shown}")
    else:
        lines.append("no node moved between stages")
    lines.append("per stage (time of one microbatch, peak memory, bytes sent):")
    for s in d.stages:
        lines.append(
            f"  stage {s.index}: nodes {s.nodes[0]} → {s.nodes[1]}; "
            f"{_change(*s.time_ms, lambda v: f'{v:.3f} ms')}; "
            f"{_change(*s.peak_memory_bytes, human_bytes)}; send {_change(*s.send_bytes, human_bytes)}"
        )
    lines.append(
        f"predicted step {_change(*d.step_ms, lambda v: f'{v:.2f} ms')}, bubble "
        f"{_change(*d.bubble_fraction, lambda v: f'{v:.1%}')}, bottleneck stage "
        f"{d.bottleneck_stage[0]} → {d.bottleneck_stage[1]}"
    )
    faster = d.step_ms[0] / d.step_ms[1] if d.step_ms[1] else float("nan")
    if d.step_ms[0] != d.step_ms[1]:
        which = names[1] if d.step_ms[1] < d.step_ms[0] else names[0]
        lines.append(f"{which} is predicted faster ({max(faster, 1 / faster if faster else 0):.2f}x)")
    return "\n".join(lines)
