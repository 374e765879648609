"""Calibrate per-node costs on whole stages.

Profiling times each node alone, many times over on the same inputs: caches are warm and the
work between nodes (autograd bookkeeping, allocation) is missed, so the sum of a stage's node
times runs 5–70% under the stage's real time, and by different amounts on different stages
(which unbalances the split). Calibration runs each stage of a plan as the runtime will — its
whole forward on one microbatch, then its whole backward — and scales the forward and backward
times of the stage's nodes so that they add up to what was measured. The planner then
partitions again on the calibrated table. The model is left as it was: gradients come from
``torch.autograd.grad`` (no ``.grad`` is written) and buffers and RNG state are restored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipecut.core.clock import Timer
from pipecut.core.meta import input_device
from pipecut.core.program import Captured, StageProgram
from pipecut.core.torch_private import pytree
from pipecut.ir import NodeCost, Plan
from pipecut.passes.rewrite.split import split
from pipecut.profile.running import LossFn, preserved_state

__all__ = ["calibrate", "stage_times"]


def _float_leaves(values: Sequence[Any], nodes: Sequence[NodeCost]) -> tuple[list[Any], list[torch.Tensor]]:
    """``values`` as a rank receives them: fresh autograd leaves where the plan says a gradient
    flows back (``Leaf.requires_grad``), detached tensors elsewhere. Marking more would be
    wrong: a buffer's value written back into the buffer (``copy_``) would make the user's
    buffer require grad."""
    leaves: list[torch.Tensor] = []
    out = []
    for value, node in zip(values, nodes):
        flat, spec = pytree.tree_flatten(value)
        fresh = []
        for x, leaf in zip(flat, node.leaves):
            if isinstance(x, torch.Tensor) and leaf.requires_grad and x.is_floating_point():
                x = x.detach().requires_grad_(True)
                leaves.append(x)
            elif isinstance(x, torch.Tensor):
                x = x.detach()
            fresh.append(x)
        out.append(pytree.tree_unflatten(fresh, spec))
    return out, leaves


def _backward_ms(outputs: list[torch.Tensor], wrt: list[torch.Tensor], timer: Timer) -> float:
    if not wrt:
        return 0.0
    grads = [torch.ones_like(t) for t in outputs]

    def backward() -> Any:
        return torch.autograd.grad(outputs, wrt, grads, retain_graph=True, allow_unused=True)

    return timer.ms(backward)


def stage_times(
    captured: Captured, plan: Plan, inputs: Sequence[Any], loss_fn: LossFn | None, target: Any,
    repeats: int = 3, prepare: Callable[[StageProgram], None] | None = None,
) -> list[tuple[float, float]]:
    """(forward ms, backward ms) of every stage of ``plan`` on one microbatch, run in order.
    ``prepare(program)`` runs on each stage program before it is timed (compiling it, say:
    the untimed warm-up run then compiles)."""
    flat = dict(zip(captured.input_names, inputs))
    timer = Timer(repeats, warmup=1, device=input_device(inputs))  # CUDA events on a GPU
    times = []
    received: list[Any] = []
    with preserved_state(captured.gm), torch.enable_grad():
        for prog in split(captured.gm, plan):
            args, leaves = _float_leaves(received, [plan.node(n) for n in prog.received])
            params: list[torch.Tensor] = [p for p in prog.module.parameters() if p.requires_grad]
            if prepare is not None:
                prepare(prog)

            def forward(prog: Any = prog, args: list[Any] = args) -> Any:
                out = prog.module(*args, *(flat[n] for n in prog.model_inputs))
                if prog.is_last and loss_fn is not None:
                    return [loss_fn(captured.unflatten_output(out), target)], out
                return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad], out

            forward_ms, (outputs, out) = timer.sampled(forward)
            backward_ms = _backward_ms(outputs, leaves + params, timer) if outputs else 0.0
            times.append((forward_ms, backward_ms))
            received = list(out) if not prog.is_last else []
    return times


def calibrate(nodes: Sequence[NodeCost], plan: Plan, times: Sequence[tuple[float, float]]) -> tuple[NodeCost, ...]:
    """Scale each stage's node times so that they add up to the measured stage times. The
    times scaled and summed are ``nodes``' (the plan's own may be another table: one rank's
    share under tensor parallelism, where the stages were timed whole)."""
    scale: dict[str, tuple[float, float]] = {}
    rows = {n.name: n for n in nodes}
    for stage, (forward_ms, backward_ms) in zip(plan.stages, times):
        members = [rows[n] for n in stage.nodes]
        f = sum(n.forward_ms for n in members)
        b = sum(n.backward_ms for n in members)
        factors = (forward_ms / f if f > 0 else 1.0, backward_ms / b if b > 0 else 1.0)
        scale.update(dict.fromkeys(stage.nodes, factors))
    return tuple(
        dataclasses.replace(n, forward_ms=n.forward_ms * scale[n.name][0], backward_ms=n.backward_ms * scale[n.name][1])
        if n.name in scale
        else n
        for n in nodes
    )
