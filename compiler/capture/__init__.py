"""pipecut.capture: a model as a torch.fx graph, and the guards that keep capture honest.

:func:`capture` (``symbolic_trace`` first, ``torch.export`` second) returns a
:class:`~pipecut.core.program.Captured`; :mod:`~pipecut.capture.guard` leaves the user's model
as it was, :mod:`~pipecut.capture.frozen` honours ``no_grad`` blocks, and
:mod:`~pipecut.capture.modes` maps the other train/eval mode's graph onto a plan, and
:func:`as_planned` rewrites a captured graph as a plan's ``chunked`` nodes say.
"""

from __future__ import annotations

from pipecut.capture.chunked import as_planned
from pipecut.capture.trace import capture, capture_as, fingerprint

__all__ = ["as_planned", "capture", "capture_as", "fingerprint"]
