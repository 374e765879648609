"""pipecut.profile: what each node costs, measured or estimated.

:mod:`~pipecut.profile.nodes` times every node on one microbatch, :mod:`~pipecut.profile.flops`
counts FLOPs and bytes, :mod:`~pipecut.profile.calibrate` rescales node costs from whole stages
timed alone, and :mod:`~pipecut.profile.live` from the running pipeline.
"""

from __future__ import annotations

__all__: list[str] = []
