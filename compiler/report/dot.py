"""Graphviz DOT export of a plan: one cluster per stage, nodes coloured by stage, cuts labelled.

``dot -Tsvg plan.dot -o plan.svg`` draws it. With ``group_by_module`` (the default) nodes are
nested in sub-clusters per module path, so a large graph reads as its model's structure.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipecut.ir import Plan
from pipecut.report.text import human_bytes

__all__ = ["GOLDEN_ANGLE", "edge_label", "stage_colour", "stage_hsv", "to_dot"]

GOLDEN_ANGLE = 137.508


def stage_colour(stage: int, lightness: int = 62) -> str:
    """A distinct, stable colour per stage (hues a golden angle apart), as CSS ``hsl()``."""
    return f"hsl({(stage * GOLDEN_ANGLE + 210) % 360:.0f}, 65%, {lightness}%)"


def stage_hsv(stage: int) -> str:
    """The same hue in Graphviz's "H S V" form (each 0..1)."""
    hue = ((stage * GOLDEN_ANGLE + 210) % 360) / 360
    return f"{hue:.3f} 0.55 0.92"


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def edge_label(shape: Iterable[int] | None, dtype: str | None, nbytes: int) -> str:
    """``[4, 64, 128] float32 · 128.0 KiB``: the label of a cut edge, here and in the HTML.

    Values that are not one tensor (sizes, tuples) have no shape: "value · 0 B".
    """
    if shape is None:
        return f"{dtype or 'value'} · {human_bytes(nbytes)}"
    dims = "[" + ", ".join(str(d) for d in shape) + "]"
    return f"{dims} {dtype or ''} · {human_bytes(nbytes)}".replace("  ", " ")


def to_dot(plan: Plan, *, group_by_module: bool = True) -> str:
    """The plan's stage graph in DOT; every data edge is drawn, cut edges bold and labelled."""
    stage_of = plan.stage_of()
    lines = ["digraph plan {", "  rankdir=LR;", "  compound=true;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [color="#777777", fontname="Helvetica", fontsize=9];']
    for stage in plan.stages:
        lines.append(f"  subgraph cluster_stage_{stage.index} {{")
        lines.append(f"    label={_q(f'stage {stage.index} ({stage.device}) {stage.time_ms:.2f} ms')};")
        lines.append('    style="rounded"; color="#444444";')
        open_path: list[str] = []
        for name in stage.nodes:
            node = plan.node(name)
            path = node.module.split(".") if group_by_module and node.module else []
            common = 0
            while common < min(len(open_path), len(path)) and open_path[common] == path[common]:
                common += 1
            while len(open_path) > common:
                lines.append("    " + "  " * (len(open_path) - 1) + "}")
                open_path.pop()
            for part in path[common:]:
                open_path.append(part)
                cid = f"cluster_s{stage.index}_" + "_".join(open_path).replace("-", "_")
                lines.append("    " + "  " * (len(open_path) - 1) + f"subgraph {_q(cid)} {{")
                lines.append("    " + "  " * len(open_path) + f"label={_q('.'.join(open_path))};")
                lines.append("    " + "  " * len(open_path) + 'style="dashed"; color="#999999";')
            label = f"{name}\\n{node.forward_ms + node.backward_ms:.2f} ms"
            lines.append("    " + "  " * len(open_path)
                         + f'{_q(name)} [label="{label}", fillcolor={_q(stage_hsv(stage.index))}];')
        while open_path:
            lines.append("    " + "  " * (len(open_path) - 1) + "}")
            open_path.pop()
        lines.append("  }")
    cut = {e.src_node: e for e in plan.edges}
    for node in plan.nodes:
        if node.name not in stage_of:
            continue
        for src in node.inputs:
            if src not in stage_of:
                continue
            e = cut.get(src)
            if e is not None and stage_of[node.name] != e.src_stage:
                label = edge_label(e.shape, e.dtype, e.bytes)
                lines.append(f"  {_q(src)} -> {_q(node.name)} "
                             f'[label={_q(label)}, penwidth=2, color="#c0392b"];')
            else:
                lines.append(f"  {_q(src)} -> {_q(node.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
