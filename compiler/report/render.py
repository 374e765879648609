"""``pipecut.render(plan, path)``: one self-contained HTML file that shows a plan.

The page holds the stage graph (nodes coloured by stage, folded by module so a graph of
thousands of nodes stays readable; cut edges labelled with shape and bytes), per-stage bars
(forward, backward, recompute, communication; memory against capacity), the predicted schedule
as a Gantt chart and, when given, the measured timeline. CSS, JavaScript and SVG are inline:
the file works offline and can be attached to a bug report as it is.

The charts are computed here (pure functions of the plan, so they are tested without a
browser) and drawn as SVG by the Jinja templates in ``templates/``; only the folding stage graph
needs JavaScript (``templates/graph.js``). A ``.dot`` path writes Graphviz DOT instead.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from pipecut.ir import Plan
from pipecut.report.dot import edge_label, stage_colour, to_dot
from pipecut.report.gantt import Span, load_trace, predicted_spans, recompute_ms
from pipecut.report.text import human_bytes
from pipecut.schedules.format import Action, ActionKind

__all__ = [
    "CHART_WIDTH",
    "ROW",
    "Chart",
    "Rect",
    "gantt",
    "graph_data",
    "memory_bars",
    "nice_ticks",
    "render",
    "render_html",
    "time_bars",
]

CHART_WIDTH = 900
"""Width in px of the drawing area of bars and Gantt charts (labels come on top of it)."""
ROW = 26


@dataclass(frozen=True, kw_only=True, slots=True)
class Rect:
    """One coloured box of a chart, in px, with its tooltip and optional inner label."""

    x: float
    y: float
    w: float
    h: float
    fill: str
    tip: str
    label: str = ""
    css: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Chart:
    """An SVG chart: boxes, row labels on the left and an axis of ticks."""

    height: float
    rects: tuple[Rect, ...]
    rows: tuple[tuple[float, str], ...]
    """(y of the row's middle, label)."""
    ticks: tuple[tuple[float, str], ...] = ()
    """(x, label) along the bottom axis."""
    marks: tuple[Rect, ...] = ()
    """Thin markers drawn over the boxes (memory capacity)."""


def nice_ticks(limit: float, count: int = 6) -> list[float]:
    """Round tick values from 0 to at least ``limit`` (1, 2 or 5 times a power of ten apart)."""
    if limit <= 0 or not math.isfinite(limit):
        return [0.0]
    raw = limit / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(limit / step + 1e-9) + 1)]


def _ms(value: float) -> str:
    return f"{value:.3g} ms" if value < 10 else f"{value:.1f} ms"


def time_bars(plan: Plan) -> Chart:
    """Per stage: forward, backward, recompute and communication ms of one microbatch."""
    widest = max((s.time_ms for s in plan.stages), default=0.0) or 1.0
    scale = CHART_WIDTH / widest
    rects, rows = [], []
    for s in plan.stages:
        y = s.index * ROW
        recompute = recompute_ms(plan, s.index)
        parts = (
            ("forward", s.forward_ms, stage_colour(s.index), ""),
            ("backward", s.backward_ms - recompute, stage_colour(s.index, 42), ""),
            ("recompute", recompute, stage_colour(s.index, 42), "hatch"),
            ("communication", s.comm_ms, "#9aa0a6", ""),
        )
        x = 0.0
        for name, ms, fill, css in parts:
            if ms <= 0:
                continue
            w = ms * scale
            rects.append(Rect(x=x, y=y + 3, w=w, h=ROW - 6, fill=fill, css=css,
                              tip=f"stage {s.index} {name}: {_ms(ms)}",
                              label=_ms(ms) if w > 60 else ""))
            x += w
        rows.append((y + ROW / 2, f"stage {s.index}"))
    ticks = tuple((t * scale, f"{t:g}") for t in nice_ticks(widest) if t * scale <= CHART_WIDTH + 1)
    return Chart(height=len(plan.stages) * ROW, rects=tuple(rects), rows=tuple(rows), ticks=ticks)


def memory_bars(plan: Plan) -> Chart:
    """Per stage: predicted peak memory against the device's capacity (a red mark)."""
    capacities = [d.memory_bytes for d in plan.devices]
    widest = max([s.peak_memory_bytes for s in plan.stages] + [c or 0 for c in capacities]) or 1
    scale = CHART_WIDTH / widest
    rects, rows, marks = [], [], []
    for s, cap in zip(plan.stages, capacities):
        y = s.index * ROW
        over = cap is not None and s.peak_memory_bytes > cap
        limit = "no limit" if cap is None else human_bytes(cap)
        w = s.peak_memory_bytes * scale
        rects.append(Rect(
            x=0, y=y + 3, w=w, h=ROW - 6, fill="#d93025" if over else stage_colour(s.index),
            tip=(f"stage {s.index}: peak {human_bytes(s.peak_memory_bytes)} of {limit} "
                 f"(parameters {human_bytes(s.param_bytes)}, activations "
                 f"{human_bytes(s.activation_bytes)} per microbatch)"),
            label=f"{human_bytes(s.peak_memory_bytes)} / {limit}" if w > 120 else "",
        ))
        if cap is not None:
            marks.append(Rect(x=cap * scale - 1, y=y, w=2, h=ROW, fill="#d93025",
                              tip=f"device {s.index} capacity {limit}"))
        rows.append((y + ROW / 2, f"stage {s.index}"))
    unit = 1024 ** min(max(int(math.log(widest, 1024)), 0), 3)  # round steps of KiB, MiB, GiB
    step = [t * unit for t in nice_ticks(widest / unit)]
    ticks = tuple((t * scale, human_bytes(t)) for t in step if t * scale <= CHART_WIDTH + 1)
    return Chart(height=len(plan.stages) * ROW, rects=tuple(rects), rows=tuple(rows),
                 ticks=ticks, marks=tuple(marks))


def gantt(spans: Sequence[Span], ranks: int) -> Chart:
    """One row per rank, one box per action: forwards light, backwards dark in the stage colour."""
    end = max((s.end for s in spans), default=0.0) or 1.0
    scale = CHART_WIDTH / end
    rects = []
    for s in spans:
        try:
            action = Action.parse(s.action)
            stage, backward = action.stage, action.kind is ActionKind.BACKWARD
        except ValueError:
            stage, backward = s.rank, False  # a measured event we do not know: draw it neutral
        w = max((s.end - s.start) * scale, 0.5)
        rects.append(Rect(
            x=s.start * scale, y=s.rank * ROW + 3, w=w, h=ROW - 6,
            fill=stage_colour(stage, 42 if backward else 66),
            tip=f"rank {s.rank} {s.action}: {s.start:.2f} → {s.end:.2f} ms ({_ms(s.end - s.start)})",
            label=s.action if w > 8 * len(s.action) else "",
            css="dark" if backward else "",
        ))
    rows = tuple((r * ROW + ROW / 2, f"rank {r}") for r in range(ranks))
    ticks = tuple((t * scale, f"{t:g}") for t in nice_ticks(end) if t * scale <= CHART_WIDTH + 1)
    return Chart(height=ranks * ROW, rects=tuple(rects), rows=rows, ticks=ticks)


def graph_data(plan: Plan) -> dict[str, Any]:
    """The stage graph for ``graph.js``: partitioned nodes in order, their edges, the cuts."""
    stage_of = plan.stage_of()
    names = [n.name for n in plan.nodes if n.name in stage_of]
    index = {name: i for i, name in enumerate(names)}
    nodes: list[dict[str, Any]] = []
    edges: list[list[int]] = []
    for name in names:
        n = plan.node(name)
        nodes.append({
            "name": name, "stage": stage_of[name], "module": n.module, "op": n.op.value,
            "target": n.target, "ms": round(n.forward_ms + n.backward_ms, 4),
            "shape": list(n.shape) if n.shape is not None else None, "dtype": n.dtype,
            "bytes": n.output_bytes,
        })
        edges.extend([index[src], index[name]] for src in n.inputs if src in index)
    cuts = {e.src_node: {"label": edge_label(e.shape, e.dtype, e.bytes), "bytes": e.bytes}
            for e in plan.edges}
    stages = [{"index": s.index, "device": s.device, "colour": stage_colour(s.index),
               "ms": round(s.time_ms, 4)} for s in plan.stages]
    return {"nodes": nodes, "edges": edges, "cuts": cuts, "stages": stages}


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("pipecut.report", "templates"),
        autoescape=jinja2.select_autoescape(default=True),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["bytes"] = human_bytes
    env.filters["ms"] = _ms
    return env


def render_html(plan: Plan, timeline: Sequence[Span] | None = None, title: str | None = None) -> str:
    """The report as a string; see :func:`render`."""
    predicted = predicted_spans(plan)
    simulated = max((s.end for s in predicted), default=0.0)
    measured = None
    if timeline:
        ranks = max(max(s.rank for s in timeline) + 1, plan.num_ranks)
        measured = {"chart": gantt(timeline, ranks), "end": max(s.end for s in timeline)}
    p = plan.predicted
    return _environment().get_template("plan.html.j2").render(
        title=title or f"pipecut plan {plan.fingerprint[:12]}",
        plan=plan,
        speedup=(p.single_device_ms / p.step_ms) if p.step_ms else float("nan"),
        stage_colour=stage_colour,
        time_chart=time_bars(plan),
        memory_chart=memory_bars(plan),
        gantt_chart=gantt(predicted, plan.num_ranks),
        simulated_ms=simulated,
        measured=measured,
        graph=graph_data(plan),
        edge_label=edge_label,
        width=CHART_WIDTH,
        escape=html.escape,
    )


def render(
    plan: Plan | str | Path,
    path: str | Path,
    *,
    timeline: Sequence[Span] | str | Path | dict[str, Any] | None = None,
    title: str | None = None,
) -> Path:
    """Write ``plan`` (a Plan or a plan JSON path) as self-contained HTML, or DOT for ``.dot``.

    ``timeline`` is a measured run to draw under the prediction: spans, or a Chrome trace (a
    path or its parsed JSON) as written by the runtime.
    """
    if not isinstance(plan, Plan):
        plan = Plan.from_json(plan)
    out = Path(path)
    if out.suffix.lower() in (".dot", ".gv"):
        out.write_text(to_dot(plan))
        return out
    spans = load_trace(timeline) if isinstance(timeline, (str, Path, dict)) else timeline
    out.write_text(render_html(plan, spans, title))
    return out
