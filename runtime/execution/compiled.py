"""Compiled stages: each stage module called through ``torch.compile`` (inductor), in place.

A stage program is one flat ``fx.GraphModule``; ``nn.Module.compile`` makes calling it run the
compiled code while the module keeps its parameters, buffers and ``state_dict`` keys (unlike
``torch.compile(module)``, which wraps it in an ``OptimizedModule`` whose keys gain an
``_orig_mod.`` prefix). Whatever calls the module (the stage worker, ``torch.utils.checkpoint``
for a stage that recomputes, a segment's checkpoint inside it) then runs compiled code.

Shapes: ``dynamic=None`` (torch's automatic dynamic) compiles the first shape static, and on
the first change (a shorter sequence, a smaller last batch) compiles once more with the
changing sizes symbolic; later sizes reuse that graph, except a microbatch of one sample
(Dynamo specializes sizes 0 and 1). ``eval()``, ``no_grad`` and autocast are guards: each state
is a graph of its own. So the graphs of a stage are bounded by the kinds of steps it runs, not
their number; past torch's ``recompile_limit`` (8 per stage) Dynamo would run the stage eagerly,
which :class:`CompileStats` (the graphs each stage compiled, their input shapes, the seconds)
makes visible.

The inductor cache (``TORCHINDUCTOR_CACHE_DIR``, by default one directory per user under the
system's temporary directory) is shared by every process of a host: a stage whose compiled
graph is the same as another's (the middle blocks of a transformer at K = 4) is compiled once
and read from the cache by the other ranks, and a second run starts warm.

Zero-bubble schedules are refused: their split backward (:mod:`pipecut.runtime.execution.backward_split`)
walks the stage's autograd graph to run input and weight gradients apart, and a compiled stage's
backward is one fused autograd node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipecut.core.torch_private import inductor_backend, inductor_cache_hits
from pipecut.errors import PlanError
from pipecut.ir import Plan

__all__ = ["CompileStats", "check_compilable", "compile_stage", "uncompile_stage"]


@dataclass
class CompileStats:
    """What compiling one stage module cost so far (it grows at each recompile)."""

    stage: int
    graphs: int = 0
    """Graphs compiled: one per shape family, mode and autocast state (and per graph break)."""
    seconds: float = 0.0
    """Wall seconds of the calls that compiled (Dynamo's tracing, AOTAutograd and inductor,
    forward and backward graphs, and that call's own run, which is small beside them)."""
    cache_hits: int = 0
    """Inductor FX graph cache hits while compiling them: graphs read back instead of compiled
    (a stage another rank of the host compiled first, or a warm cache from an earlier run)."""
    shapes: list[str] = field(default_factory=list)
    """The input shapes of the call that compiled each graph, in order (a graph compiled with
    dynamic sizes serves other sizes too)."""


class _CountingBackend:
    """The inductor backend, counting what it compiles for one stage."""

    def __init__(self, stats: CompileStats) -> None:
        self.stats = stats
        self.inductor: Callable[..., Any] = inductor_backend()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        hits = inductor_cache_hits()
        compiled = self.inductor(gm, example_inputs)
        self.stats.graphs += 1
        self.stats.cache_hits += inductor_cache_hits() - hits
        self.stats.shapes.append(", ".join(
            str(tuple(t.shape)) for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0
        ) or "()")
        return compiled


def check_compilable(plan: Plan, *, data_parallel: bool = False) -> None:
    """Refuse, before anything is built, a plan whose stages cannot run compiled."""
    if data_parallel:
        raise PlanError(
            "compile_stages with data parallelism (DDP or FSDP over pipeline replicas) is not "
            "supported yet: the wrappers' gradient hooks around a compiled stage are untested "
            "here; drop the 'dp' dimension or compile_stages"
        )
    if plan.schedule.splits_backward:
        raise PlanError(
            f"compile_stages cannot run the {plan.schedule.value} schedule: its split backward "
            f"walks each stage's autograd graph to run the input gradients (I) and the weight "
            f"gradients (W) apart, and a compiled stage's backward is one fused node; use "
            f"schedule='1f1b' or 'interleaved-1f1b' with compile_stages, or compile_stages=False"
        )


def compile_stage(module: torch.nn.Module, stage: int, *, dynamic: bool | None = None) -> CompileStats:
    """Make calls of ``module`` run through ``torch.compile`` (inductor), in place; the
    compile itself happens at the first call. Returns the stats that call and later ones fill."""
    stats = CompileStats(stage=stage)
    module.compile(backend=_CountingBackend(stats), dynamic=dynamic)
    compiled: Callable[..., Any] | None = module._compiled_call_impl  # what __call__ now runs
    assert compiled is not None

    def timed(*args: Any, **kwargs: Any) -> Any:
        graphs, start = stats.graphs, time.perf_counter()
        out = compiled(*args, **kwargs)
        if stats.graphs != graphs:  # this call compiled
            stats.seconds += time.perf_counter() - start
        return out

    module._compiled_call_impl = timed
    return stats


def uncompile_stage(module: torch.nn.Module) -> None:
    """Undo :func:`compile_stage`: calls of ``module`` run eagerly again. ``nn.Module.compile``
    keeps the compiled callable in ``_compiled_call_impl``, which ``__call__`` prefers when set;
    torch has no public inverse."""
    module._compiled_call_impl = None
