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

A stage compiled whole, and each run compiled apart (below), returns its outputs as fresh
tensors (:func:`copied_outputs`): where an output is a view, AOTAutograd regenerates it from its
base by recorded view ops, which its cache stores wrong on torch 2.13, and by ``as_strided``
where the base is an input, which a DTensor refuses.

Zero-bubble and ZBV split each backward into an input pass and a weight pass
(:mod:`pipecut.runtime.execution.backward_split`), which find each weight's gradient at the
autograd node of the op that reads the weight. A stage compiled whole has one fused autograd node
for everything: its weight pass would run the whole compiled backward again. Under those
schedules :func:`compile_apart` compiles the stage apart instead: each run of the graph's nodes
that reads no parameter (norms' arithmetic, activations, attention, residual adds, reshapes) is
one compiled function, and the ops that read a parameter (the products, the norms' scales, a
recomputed segment) run eagerly between them. The compiled runs' backwards are input gradients
only, which the input pass needs anyway; each weight's product keeps its own autograd node, which
the weight pass runs later, as Megatron's zero-bubble defers only the weight GEMMs. What inductor
fuses is then the elementwise work between the products, not the products with their epilogues.

A stage split over a tensor group (its parameters DTensors: :mod:`pipecut.assemble.tensor`) is
compiled apart too, under every schedule, and its region ends (the nodes marked
:data:`~pipecut.core.graph.EAGER`: a value entering or leaving DTensor computation, a collective)
end a run and run eagerly: torch.compile of a whole stage holding DTensors failed on torch 2.13
(a vocabulary-split embedding's masked partial sum made whole under fake tensors, as in
pytorch#160697; guards on DTensor specs across a graph break; ``as_strided`` on a DTensor where
AOTAutograd regenerates a view). Apart, the parameter ops and the region ends are eager DTensor
code and the runs between them compile: inside a region on DTensor activations (an activation
function on the hidden features, attention on each rank's heads), outside on plain tensors.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from pipecut.core.graph import EAGER, node_parameters
from pipecut.core.segment import Segment
from pipecut.core.torch_private import (
    OpOverload,
    inductor_backend,
    inductor_cache_hits,
    kept_saved_tensors,
)

__all__ = ["CompileStats", "compile_apart", "compile_program", "compile_stage", "copied_outputs", "uncompile_stage",
           "weightless_runs"]


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
    runs: int | None = None
    """Compiled apart (:func:`compile_apart`): the runs it calls compiled; 0 where the stage has
    none (every op reads a parameter, is a region end, or stands alone) and runs eagerly.
    None: compiled whole."""


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


def compile_program(module: fx.GraphModule, stage: int, *, dynamic: bool | None = None) -> tuple[CompileStats, fx.Graph]:
    """A stage program compiled whole, as ``compile_stages=True`` runs it: :func:`copied_outputs`,
    then :func:`compile_stage`. Returns the stats and the graph it had (for :func:`uncompile_stage`)."""
    graph = copied_outputs(module)
    return compile_stage(module, stage, dynamic=dynamic), graph


def copied_outputs(module: fx.GraphModule) -> fx.Graph:
    """Make ``module`` return a copy of each tensor output that is, or may be, a view of another
    value, in place; returns the graph it had.

    AOTAutograd gives a compiled graph's output that aliases an intermediate, an input or another
    output back as a view regenerated from its base by the recorded view ops, and its cache
    (``torch._functorch.config.enable_autograd_cache``, on by default) stores those ops wrong:
    on torch 2.13, a cache hit on the Llama's first stage cut inside its attention (the outputs
    ``transpose(view(q_proj(x), [1, s, -1, 16]))`` and a slice of it) regenerated it at sizes
    ``[94532436039015, 427572148184147232, 64]`` in every process after the first, and a rank
    that read the entry while another wrote it died. A stage's outputs are sent to another stage
    or reach the loss, which never rely on their aliasing, so each comes back fresh and no view
    is regenerated. Which outputs: those of a torch op whose schema returns an alias (``view``,
    ``transpose``, ``slice``, ``expand``, ``to``…), and those of calls with no schema (a
    ``symbolic_trace`` graph's ``x.view``), which may alias; an op's fresh result is left alone."""
    original = module.graph
    graph = fx.Graph()
    graph._codegen = original._codegen
    env: dict[fx.Node, fx.Node] = {}
    for node in original.nodes:
        if node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], lambda a: _copy_of(graph, env[a], a)))
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    module.graph = graph
    module.recompile()
    return original


def _copy_of(graph: fx.Graph, value: fx.Node, node: fx.Node) -> fx.Node:
    """``value`` (the copy of ``node``), or a call that copies it where ``node`` may be a view."""
    target = node.target
    if node.op == "call_function" and isinstance(target, OpOverload) and not any(
            r.alias_info is not None for r in target._schema.returns):
        return value  # a fresh result
    if node.op == "call_function" and target is operator.getitem and isinstance(node.args[0], fx.Node) and (
            node.args[0].op == "call_function" and isinstance(node.args[0].target, OpOverload)
            and not any(r.alias_info is not None for r in node.args[0].target._schema.returns)):
        return value  # one of a fresh tuple's results (an op with several outputs)
    return graph.call_function(_fresh, (value,))


def _fresh(value: Any) -> Any:
    """A copy of a tensor (what a compiled stage returns for an output that may alias); anything
    else, such as a size, as it is."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def uncompile_stage(module: torch.nn.Module, graph: fx.Graph | None = None) -> None:
    """Undo :func:`compile_stage`: calls of ``module`` run eagerly again. ``nn.Module.compile``
    keeps the compiled callable in ``_compiled_call_impl``, which ``__call__`` prefers when set;
    torch has no public inverse. ``graph``: undo :func:`compile_program` or :func:`compile_apart`,
    whose stage graph it was."""
    module._compiled_call_impl = None
    if graph is not None:
        assert isinstance(module, fx.GraphModule)
        module.graph = graph
        module.recompile()


MIN_RUN = 2
"""Runs of fewer weightless nodes stay eager: a lone reshape gains nothing from a compiled call."""


def weightless_runs(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The maximal runs of consecutive nodes of ``gm`` that read no parameter, in graph order:
    ``call_function`` and ``call_method`` nodes, and calls of leaf modules that hold no tensor
    (an ``nn.GELU`` or ``nn.Dropout`` of a ``symbolic_trace`` capture). Placeholders and
    ``get_attr`` nodes between them do not end a run: they only name values. A call of a module
    with parameters ends one, and so do a recomputed segment (it runs its checkpoint eagerly)
    and a node marked :data:`~pipecut.core.graph.EAGER`. Runs of fewer than :data:`MIN_RUN`
    nodes are left out."""
    params = {n for n in gm.graph.nodes if n.op == "get_attr" and node_parameters(n, gm)}
    runs: list[list[fx.Node]] = [[]]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if _weightless(node, gm) and not node.meta.get(EAGER) and not params.intersection(node.all_input_nodes):
            runs[-1].append(node)
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if len(run) >= MIN_RUN]


def _weightless(node: fx.Node, gm: fx.GraphModule) -> bool:
    """An op, or a call of a leaf module that holds no tensor (no parameter, and no buffer a
    BatchNorm-like module would update as it runs) and is no recomputed segment."""
    if node.op in ("call_function", "call_method"):
        return True
    if node.op != "call_module":
        return False
    module = gm.get_submodule(str(node.target))
    return (not isinstance(module, Segment) and next(module.children(), None) is None
            and next(module.parameters(), None) is None and next(module.buffers(), None) is None)


def compile_apart(module: fx.GraphModule, stage: int, *, dynamic: bool | None = None) -> tuple[CompileStats, fx.Graph]:
    """Make ``module`` (a stage program) call each of its :func:`weightless_runs` through
    ``torch.compile`` (inductor), its ops that read parameters eagerly, in place: its graph is
    swapped for one that calls a compiled function per run (see the module docstring). Returns
    the stats its compiles fill and the graph it had (for :func:`uncompile_stage`)."""
    runs = weightless_runs(module)
    stats = CompileStats(stage=stage, runs=len(runs))
    backend = _CountingBackend(stats)
    original = module.graph
    graph = fx.Graph()
    graph._codegen = original._codegen
    env: dict[fx.Node, fx.Node] = {}
    last = {run[-1]: run for run in runs}
    inside = {n for run in last.values() for n in run}
    for node in original.nodes:
        if node in last:
            run = last[node]
            sub, inputs, outputs = _extract(run, module)
            copied_outputs(sub)  # no view of an input or intermediate is regenerated (a DTensor cannot be)
            call = graph.call_function(_timed(torch.compile(sub, backend=backend, dynamic=dynamic), stats),
                                       tuple(env[a] for a in inputs))
            for i, out in enumerate(outputs):
                env[out] = graph.call_function(operator.getitem, (call, i))
        elif node not in inside:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.lint()
    module.graph = graph
    module.recompile()
    return stats, original


def _timed(compiled: Callable[..., Any], stats: CompileStats) -> Callable[..., Any]:
    """A compiled run as a graph's call target (which needs a name), adding the seconds of the
    calls that compiled to ``stats``."""

    def compiled_run(*args: Any) -> Any:
        graphs, start = stats.graphs, time.perf_counter()
        with kept_saved_tensors():  # compiled without donated buffers: the input pass retains the graph
            out = compiled(*args)
        if stats.graphs != graphs:
            stats.seconds += time.perf_counter() - start
        return out

    return compiled_run


def _extract(run: list[fx.Node], root: fx.GraphModule) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """The run as a graph of its own: the values it reads from outside as placeholders, the
    values read after it as outputs, the modules it calls shared with ``root``."""
    members = set(run)
    inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in members))
    outputs = [n for n in run if any(u not in members for u in n.users)]
    graph = fx.Graph()
    env = {a: graph.placeholder(a.name) for a in inputs}
    for n in run:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(root, graph), inputs, outputs
