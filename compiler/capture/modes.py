"""Train and eval mode for a compiled pipeline: the graph of the other mode, cut like the plan.

Capture fixes the training flag into the graph (``torch.export`` specialises dropout and
batch norm to the mode it ran in; ``symbolic_trace`` evaluates ``self.training`` branches), so
``pipe.eval()`` needs the graph captured in eval mode (and ``pipe.train()`` on a model compiled
in eval mode, the train-mode graph). Every rank captures it at compile time, with the plan's
capture method, from the same model and microbatch, so all ranks derive the same programs
without communication and the plan format is unchanged. Identical graphs (a model whose
modules handle the mode at run time, as symbolic_trace's ``nn.Dropout``/``nn.BatchNorm``
leaves do) share one set of programs; otherwise the graph is described by running it on fake
tensors (shapes, dtypes, which values need gradients: no real compute, no state touched) and
its nodes are mapped onto the plan's stages by :func:`pipecut.passes.rewrite.eval_graph.map_stages`.
If the other mode cannot be captured or mapped, switching to it raises that error; training
in the compiled mode is unaffected.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from pipecut.capture import as_planned, capture, fingerprint
from pipecut.core.cut_values import describe
from pipecut.core.graph import attr_tensor, module_path, node_parameters, target_name
from pipecut.core.kinds import NodeOp
from pipecut.core.program import Captured, Inputs, StageProgram
from pipecut.core.torch_private import FakeTensorMode, reparametrize_module
from pipecut.errors import InputError
from pipecut.ir import NodeCost, Plan
from pipecut.options import UNBOUNDED
from pipecut.passes.rewrite.eval_graph import map_stages
from pipecut.passes.rewrite.split import split_stage
from pipecut.runtime.execution.stage import StageWorker

__all__: list[str] = []

MakeWorker = Callable[[StageProgram, Plan, Callable[[Any], Any]], StageWorker]
Adapt = Callable[[Captured, Plan, Mapping[int, StageWorker]], Mapping[int, StageWorker]]
"""What the build does to the captured mode's workers after making them (tensor parallelism
splits them over the tensor group), done to the other mode's: ``(graph, plan, workers) -> workers``."""


def module_modes(model: torch.nn.Module) -> tuple[tuple[str, bool], ...]:
    return tuple((name, m.training) for name, m in model.named_modules())


def _set_modes(model: torch.nn.Module, modes: Sequence[tuple[str, bool]]) -> None:
    for name, training in modes:
        model.get_submodule(name).training = training


def state_names(gm: torch.nn.Module) -> dict[int, str]:
    """id(parameter or buffer) -> its first fully qualified name (tied aliases share one)."""
    names: dict[int, str] = {}
    for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), name)
    return names


def state_reads(gm: fx.GraphModule, names: Mapping[int, str]) -> dict[str, tuple[str, ...]]:
    """Per unit (not placeholder/get_attr): the parameters and buffers it reads, directly (a
    module's own) or through ``get_attr`` inputs, by canonical name."""

    def own(node: fx.Node) -> list[str]:
        if node.op == "get_attr":
            value = attr_tensor(node, gm)
            return [names[id(value)]] if value is not None and id(value) in names else []
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            tensors = [*module.parameters(), *module.buffers()]
            return [names[id(t)] for t in tensors if id(t) in names]
        return []

    reads: dict[str, tuple[str, ...]] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        found = own(node) + [f for a in node.all_input_nodes if a.op == "get_attr" for f in own(a)]
        reads[node.name] = tuple(dict.fromkeys(found))
    return reads


def capture_in_mode(
    model: torch.nn.Module, inputs: Inputs, training: bool, like: Captured, leaf_modules: Sequence[type | str]
) -> Captured:
    """``model`` captured as in ``like`` but with ``model.train(training)``; the modes of its
    modules are restored afterwards. Shapes as in ``like`` too, with no time limit: a bound
    could run out on one rank and not on another, and the ranks would derive different graphs
    (``like``'s own symbolic-shape export did finish)."""
    before = module_modes(model)
    model.train(training)
    try:
        return capture(model, inputs, method=like.method, leaf_modules=leaf_modules,
                       dynamic_shapes=not like.static_shapes, time_limit=UNBOUNDED)
    finally:
        _set_modes(model, before)


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        self.values[n.name] = value
        return value


def describe_graph(captured: Captured, flat_inputs: Sequence[Any]) -> tuple[NodeCost, ...]:
    """Rows for every node of ``captured.gm`` (no costs): output leaves, shapes, dtypes,
    whether each needs gradients, parameters read. Runs on fake tensors made from the module's
    state, so nothing is computed and no parameter or buffer changes."""
    gm = captured.gm
    state = {**dict(gm.named_parameters(remove_duplicate=False)), **dict(gm.named_buffers(remove_duplicate=False))}
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        fake_state: dict[str, torch.Tensor] = {k: mode.from_tensor(v) for k, v in state.items()}
        fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
    recorder = _Recorder(gm)
    with mode, torch.enable_grad(), reparametrize_module(gm, fake_state):
        recorder.run(*fake_inputs)
    params = {id(p): n for n, p in reversed(list(gm.named_parameters(remove_duplicate=False)))}
    rows = []
    for node in gm.graph.nodes:
        value = recorder.values.get(node.name)
        leaves, treespec = ((), None) if node.op == "output" else describe(value)
        first = next((leaf for leaf in leaves if leaf.shape or leaf.dtype), None)
        rows.append(NodeCost(
            name=node.name,
            op=NodeOp(node.op),
            target=target_name(node) if node.op != "output" else "output+loss",
            module=module_path(node),
            inputs=tuple(n.name for n in node.all_input_nodes),
            parameters=tuple(dict.fromkeys(params[id(p)] for _, p in node_parameters(node, gm) if id(p) in params)),
            shape=first.shape if first is not None else None,
            dtype=first.dtype if first is not None else None,
            leaves=leaves,
            treespec=treespec,
        ))
    return tuple(rows)


def share_state(gm: torch.nn.Module, like: torch.nn.Module) -> None:
    """Make ``gm`` hold ``like``'s parameter and buffer objects under the same names, so the
    two modes' programs read (and train) the very same tensors."""
    source = {**dict(like.named_parameters(remove_duplicate=False)), **dict(like.named_buffers(remove_duplicate=False))}
    for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        src = source.get(name)
        if src is None or src is t:
            continue
        owner, _, attr = name.rpartition(".")
        module = gm.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = src  # type: ignore[assignment]
        else:
            module._buffers[attr] = src


def derive_other_mode(
    model: torch.nn.Module, inputs: Inputs, captured: Captured, plan: Plan, leaf_modules: Sequence[type | str]
) -> tuple[Captured, Plan] | None:
    """The other mode's graph and its plan (the same stages, re-cut), or None when the other
    mode captures the very same graph. Deterministic: every rank derives the same."""
    other = capture_in_mode(model, inputs, not model.training, captured, leaf_modules)
    other = as_planned(other, plan.chunked)  # ``captured`` is the plan's (rewritten) graph too
    if fingerprint(other.gm) == fingerprint(captured.gm):
        return None
    if other.input_names != captured.input_names:
        raise InputError(
            f"the model takes inputs {list(other.input_names)} in "
            f"{'train' if not model.training else 'eval'} mode but {list(captured.input_names)} "
            f"in the mode it was compiled in; pipecut needs one signature for both modes"
        )
    share_state(other.gm, captured.gm)
    before = module_modes(model)
    model.train(not model.training)  # call_module leaves (BatchNorm) run as in that mode
    try:
        rows = describe_graph(other, other.flatten_inputs(inputs))
    finally:
        _set_modes(model, before)
    names = state_names(captured.gm)
    names.update({k: v for k, v in state_names(other.gm).items() if k not in names})
    stages = map_stages(plan, state_reads(captured.gm, names), rows, state_reads(other.gm, names))
    return other, dataclasses.replace(plan, nodes=rows, stages=stages, edges=(), _index={})


class Modes:
    """This rank's stage workers per mode, and the user's model kept in step with the mode.

    The plan's graph holds the module modes the model had at compile; the other mode's graph,
    those that ``model.train(mode)`` sets. Each step checks that the model's modules are in the
    modes of the graph about to run, since a module switched by hand (``model.eval()`` instead
    of ``pipe.eval()``) would otherwise be silently ignored by a graph that fixed its mode.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        workers: Mapping[int, StageWorker],
        derived: tuple[Captured, Plan] | Exception | None,
        make_worker: MakeWorker,
        device: torch.device,
        make_wire: Callable[[Captured, Plan], Any] | None = None,
        adapt: Adapt | None = None,
    ) -> None:
        self._model = model
        self.captured_training = model.training
        other = not model.training
        self._snapshots = {self.captured_training: module_modes(model)}
        before = self._snapshots[self.captured_training]
        model.train(other)
        self._snapshots[other] = module_modes(model)
        _set_modes(model, before)
        self._workers: dict[bool, Mapping[int, StageWorker]] = {self.captured_training: dict(workers)}
        self._error: Exception | None = None
        self._wires: dict[bool, Any] = {}
        """The other mode's wire resolver, where its graph is not the captured one."""
        if isinstance(derived, Exception):
            self._error = derived
        elif derived is None:
            self._workers[other] = self._workers[self.captured_training]
        else:
            captured, plan = derived
            built = {}
            for stage in workers:
                program = split_stage(captured.gm, plan, stage)
                program.module.to(device)
                # .to() gives moved buffers new tensor objects: point both modes at the same ones.
                share_state(program.module, workers[stage].program.module)
                program.module.training = other  # not recursive: the submodules are the model's
                built[stage] = make_worker(program, plan, captured.unflatten_output)
            self._workers[other] = dict(adapt(captured, plan, built)) if adapt is not None else built
            if make_wire is not None:
                self._wires[other] = make_wire(captured, plan)

    def without_separate_mode(self, error: Exception) -> Modes:
        """These modes with ``error`` kept for the mode whose stage programs are separate from
        the captured mode's (an export graph's other mode), and those programs dropped: they
        can no longer run the captured mode's parameters (FSDP replaced them). The same modes
        where both run the same programs."""
        other = not self.captured_training
        if other not in self._workers or self._workers[other] is self._workers[self.captured_training]:
            return self
        kept = copy.copy(self)
        kept._workers = {mode: w for mode, w in self._workers.items() if mode != other}
        kept._wires = {mode: w for mode, w in self._wires.items() if mode != other}
        kept._error = error
        return kept

    def wire(self, training: bool) -> Any:
        """The mode's own wire resolver where its graph is not the captured one; None: the
        pipeline's (the captured graph's)."""
        return self._wires.get(training)

    def workers(self, training: bool) -> Mapping[int, StageWorker]:
        if training not in self._workers:
            assert self._error is not None
            raise self._error
        return self._workers[training]

    def set(self, training: bool) -> None:
        # The stage programs' submodules (call_module leaves of symbolic_trace; export programs
        # have the mode in their graphs) take the mode that model.train() gave the module of
        # the same name, so per-module modes the model's own train() sets (frozen BatchNorm)
        # are kept, whether the programs share the model's module objects or copies of them.
        self._model.train(training)
        modes = dict(module_modes(self._model))
        for workers in self._workers.values():
            for w in workers.values():
                for name, sub in w.program.module.named_modules():
                    sub.training = modes.get(name, training)

    def check(self, training: bool) -> None:
        expected = dict(self._snapshots[training])
        now = dict(module_modes(self._model))
        wrong = [n for n in expected if now.get(n) != expected[n]] + [n for n in now if n not in expected]
        if wrong:
            name = wrong[0] or "(the model)"
            mode = "train" if training else "eval"
            def word(flag: bool | None) -> str:
                return "train" if flag else "eval" if flag is not None else "absent"
            raise InputError(
                f"module {name!r} is in {word(now.get(wrong[0]))} mode, but the pipeline's "
                f"{mode}-mode graph was captured with it in {word(expected.get(wrong[0]))} mode "
                f"({len(wrong)} module(s) differ). Capture fixes modes into the graph: switch "
                f"with pipe.train()/pipe.eval() rather than model.train()/model.eval(), and set "
                f"per-module modes (e.g. frozen BatchNorm) before pipecut.compile"
            )
