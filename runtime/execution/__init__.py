"""Execution: a rank's stages running the schedule's actions.

:mod:`~pipecut.runtime.execution.executor` (walks a rank's actions and transfers),
:mod:`~pipecut.runtime.execution.stage` (one stage: one method per action kind),
:mod:`~pipecut.runtime.execution.forward` (forward-only steps, outputs, train/eval programs),
:mod:`~pipecut.runtime.execution.backward_split` (backward as I and W),
:mod:`~pipecut.runtime.execution.recompute_state` (module state written once under recompute),
:mod:`~pipecut.runtime.execution.compiled` (stages through ``torch.compile``) and
:mod:`~pipecut.runtime.execution.trace` (Chrome trace of measured and predicted steps).
"""

__all__: list[str] = []
