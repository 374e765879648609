"""pipecut.core: data every layer shares, below the passes and the runtime.

Programs (:mod:`~pipecut.core.program`: a captured graph, a stage's program), values and
shapes that cross a cut, microbatching, the user's names for graph tensors, facts about fx nodes
and meta tensors. Together with :mod:`pipecut.ir`, :mod:`pipecut.errors`,
:mod:`pipecut.schema`, :mod:`pipecut.options` and :mod:`pipecut.schedules` (the schedule
format and its simulator) this is the bottom layer: it imports no pass,
no runtime module and nothing above them.
"""

from __future__ import annotations

__all__: list[str] = []
