"""pipecut.report: views of a plan for people: HTML, text, DOT, timelines and diffs.

:func:`~pipecut.report.render.render` writes one self-contained HTML file;
:mod:`~pipecut.report.text` the summary table, :mod:`~pipecut.report.dot` Graphviz,
:mod:`~pipecut.report.gantt` predicted and measured timelines, :mod:`~pipecut.report.diff` what
moved between two plans.
"""

from __future__ import annotations

__all__: list[str] = []
