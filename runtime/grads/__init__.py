"""Gradients across ranks: loss weighting, clipping and scaling, tied weights, data parallelism.

:mod:`~pipecut.runtime.grads.collective` (loss divisor, total norm and clipping, loss scaling
over all stages), :mod:`~pipecut.runtime.grads.tied` (a weight held by several stages),
:mod:`~pipecut.runtime.grads.data_parallel` (DDP or FSDP2 across pipeline replicas) and
:mod:`~pipecut.runtime.grads.sharded_optimizer` (ZeRO-1: the optimizer state sharded over them).
"""

__all__: list[str] = []
