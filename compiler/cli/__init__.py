"""pipecut.cli: the ``pipecut`` command (``plan``, ``show``, ``diff``, ``render``).

:mod:`~pipecut.cli.main` parses the command line, :mod:`~pipecut.cli.factory` finds the user's
model from a ``MODULE:FACTORY`` spec, :mod:`~pipecut.cli.logs` sets up rank-aware logging.
"""

from __future__ import annotations

__all__: list[str] = []
