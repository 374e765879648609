"""Capture-level pieces of eval mode and frozen parts, without processes.

- ``no_grad`` blocks traced by symbolic_trace are honoured (gradients as in eager PyTorch);
- the other mode's graph: identical graphs are shared, a differing one keeps its nodes' stages,
  its nodes are re-cut consistently or refused; describing it touches no state;
- forward-only schedules never deadlock; outputs concatenate over microbatches or refuse.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Literal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipecut
from examples import mlp
from pipecut.capture import capture
from pipecut.capture.modes import Modes, derive_other_mode, describe_graph
from pipecut.core.batching import first_microbatch
from pipecut.core.kinds import CaptureMethod, NodeOp, Recompute, ScheduleKind
from pipecut.errors import InputError, PipelineRuntimeError, PlanError
from pipecut.ir import NodeCost
from pipecut.passes.partition.solve import partition_costs
from pipecut.passes.rewrite.eval_graph import map_stages
from pipecut.passes.rewrite.split import split_stage
from pipecut.runtime.execution.forward import concat_microbatches
from pipecut.runtime.execution.stage import StageWorker
from pipecut.schedules.format import ActionKind, forward_only
from pipecut.schedules.simulate import simulate
from pipecut.schedules.standard import build


class NoGradBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            f = torch.tanh(self.frozen(h))
            self.ema.mul_(0.5).add_(h.mean(0))  # an in-place update inside the block
        return self.c(h * f + h)


def test_symbolic_trace_honours_no_grad_blocks() -> None:
    torch.manual_seed(0)
    model, x = NoGradBlock(), torch.randn(4, 8)
    eager = NoGradBlock()
    eager.load_state_dict(model.state_dict())
    cap = capture(model, (x,))
    assert cap.method is CaptureMethod.SYMBOLIC_TRACE
    cap.gm(x).sum().backward()
    eager(x).sum().backward()
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        if q.grad is not None:  # exact: the same kernels in the same order
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(model.ema, eager.ema, rtol=0, atol=0)


def test_graph_without_no_grad_is_not_rewritten() -> None:
    model, inputs, _, _ = mlp.build()
    cap = capture(model, inputs)
    assert not any("detach_tree" in n.name for n in cap.gm.graph.nodes)


class FunctionalDropout(nn.Module):
    """``self.training`` evaluated at trace time: the graphs of the two modes differ."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.dropout(torch.relu(layer(x)), 0.5, self.training)
        return self.bn(x)


def _plan(model: nn.Module, x: torch.Tensor, method: CaptureMethod | Literal["auto"] = "auto") -> pipecut.Plan:
    """A 2-stage plan cut by equal node costs. Measured times would make the cut vary, and so
    would the planned graph: with measured costs, under load, one plan had 18 nodes in its stages
    instead of 14 (a heavy-looking node computed in row pieces), and a fresh clone's suite beside
    a CPU hog failed the refusal below. Counted costs on a fixed profile give one graph."""
    measured = pipecut.plan(
        model, (x,), 2, loss_fn=lambda o, t: o.pow(2).mean(), target=x, microbatches=2,
        measure=pipecut.MeasureOptions(estimate="A100-80GB"),
        capture=pipecut.CaptureOptions(method=method),
    )
    nodes = [dataclasses.replace(n, forward_ms=1.0, backward_ms=1.0) for n in measured.nodes]
    return partition_costs(nodes, devices=2, microbatches=2, batch_size=8, fingerprint=measured.fingerprint,
                           capture=measured.capture, inputs=measured.inputs)


@pytest.mark.parametrize("method", [CaptureMethod.SYMBOLIC_TRACE, CaptureMethod.EXPORT])
def test_other_mode_keeps_the_plan_stages(method: CaptureMethod) -> None:
    torch.manual_seed(0)
    model, x = FunctionalDropout(), torch.randn(8, 16)
    plan = _plan(model, x, method)
    _, first = first_microbatch((x,), 2)
    captured = capture(model, first, method=method)
    stats = {n: b.clone() for n, b in model.named_buffers()}
    derived = derive_other_mode(model, first, captured, plan, ())
    assert derived is not None and model.training  # the model's mode is restored
    other, other_plan = derived
    assert all(torch.equal(b, stats[n]) for n, b in model.named_buffers())
    flags = [n.args[2] if len(n.args) > 2 else n.kwargs.get("training") for n in other.gm.graph.nodes
             if "dropout" in str(n.target)]
    assert flags and not any(flags)  # dropout off in the eval graph
    names = {n.name for n in other.gm.graph.nodes}
    assert len(names) > 10
    for st, ost in zip(plan.stages, other_plan.stages):
        # Same names on both paths: every node keeps its stage (export's train graph also
        # counts BatchNorm's batches, an add_ that the eval graph lacks).
        assert ost.nodes == tuple(n for n in st.nodes if n in names)
        assert set(ost.parameters) == set(st.parameters)
    assert other_plan.stages[0].outputs == other_plan.stages[1].inputs

    # Recomputed blocks follow their nodes to the other graph; none there: the whole stage.
    some = plan.stages[0].nodes[2:6]
    gone = tuple(n for n in plan.stages[1].nodes if n not in names)  # export: BatchNorm's add_
    picked = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], recompute=Recompute.SELECTIVE, recomputed=some),
        dataclasses.replace(plan.stages[1], recompute=Recompute.SELECTIVE, recomputed=gone) if gone
        else plan.stages[1],
    ))
    derived = derive_other_mode(model, first, captured, picked, ())
    assert derived is not None
    mapped = derived[1]
    assert mapped.stages[0].recompute is Recompute.SELECTIVE
    assert (method is CaptureMethod.EXPORT) == bool(gone)
    if gone:
        assert mapped.stages[1].recompute is Recompute.FULL and mapped.stages[1].recomputed == ()
    assert mapped.stages[0].recomputed == tuple(n for n in some if n in names)

def test_identical_graphs_are_shared() -> None:
    model, inputs, loss_fn, target = mlp.build(batch_size=8, width=16, depth=2)
    # Planned from timings, a loaded machine could make the head "heavy" and cut it in pieces,
    # which the fresh capture below does not have: no pieces, so the check holds for any timing.
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0, calibrate=False),
        partition=pipecut.PartitionOptions(heavy_pieces=False),
    )
    _, first = first_microbatch(inputs, 2)
    assert derive_other_mode(model, first, capture(model, first), plan, ()) is None


def _row(name: str, op: NodeOp, inputs: tuple[str, ...] = (), params: tuple[str, ...] = ()) -> NodeCost:
    return NodeCost(name=name, op=op, target=name, inputs=inputs, parameters=params)


def test_mapping_places_new_nodes_and_refuses_backward_flows() -> None:
    torch.manual_seed(0)
    model, x = FunctionalDropout(), torch.randn(8, 16)
    plan = _plan(model, x)
    reads = {n.name: n.parameters for n in plan.nodes}
    first = plan.stages[0].nodes[0]  # reads layers.0's weight, held by stage 0 only
    last = plan.stages[1].nodes[-2]  # the node before the output
    held_late = plan.stages[1].parameters[0]
    x_name = plan.inputs[0]
    good = [
        _row(x_name, NodeOp.PLACEHOLDER),
        _row(first, NodeOp.CALL_FUNCTION, (x_name,), reads[first]),
        _row("new_node", NodeOp.CALL_FUNCTION, (first,)),  # no namesake: earliest stage
        _row("late", NodeOp.CALL_FUNCTION, ("new_node",), (held_late,)),  # must go to stage 1
        _row("output", NodeOp.OUTPUT, ("late",)),
    ]
    other_reads = {r.name: r.parameters for r in good}
    stages = map_stages(plan, reads, good, other_reads)
    assert stages[0].nodes == (first, "new_node") and stages[1].nodes == ("late", "output")
    assert stages[0].outputs == ("new_node",) == stages[1].inputs

    bad = [
        _row(x_name, NodeOp.PLACEHOLDER),
        _row(last, NodeOp.CALL_FUNCTION, (x_name,), reads.get(last, ())),
        _row("late", NodeOp.CALL_FUNCTION, (last,), (held_late,)),
        _row(first, NodeOp.CALL_FUNCTION, ("late",), reads[first]),  # stage-0 weight after stage 1
        _row("output", NodeOp.OUTPUT, (first,)),
    ]
    with pytest.raises(PlanError, match=rf"cannot place node '{last}'.*held by stages \[\[1\].*need it by stage 0"):
        map_stages(plan, reads, bad, {r.name: r.parameters for r in bad})


def test_describe_graph_on_fake_tensors_touches_no_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    x = torch.randn(6, 4)
    cap = capture(model, (x,))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    rows = {r.name: r for r in describe_graph(cap, [x])}
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert rows["_0"].leaves[0].shape == (6, 4) and not rows["_0"].leaves[0].requires_grad  # frozen
    assert rows["_1"].leaves[0].requires_grad and rows["_2"].leaves[0].shape == (6, 2)
    assert rows["_2"].parameters == ("2.weight", "2.bias")


@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_forward_only_schedules_do_not_deadlock(kind: ScheduleKind) -> None:
    chunks = 2 if kind in (ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.ZBV) else 1
    sched = build(kind, 3, 6, chunks)
    fwd = tuple(forward_only(r) for r in sched)
    assert all(a.kind is ActionKind.FORWARD for r in fwd for a in r)
    assert sum(len(r) for r in fwd) == 3 * chunks * 6
    assert simulate(fwd, [1.0] * 3 * chunks, [1.0] * 3 * chunks) > 0  # raises on a deadlock


def test_outputs_concatenate_over_microbatches() -> None:
    mbs = [{"logits": torch.full((2, 3), float(i)), "n": 7, "scale": torch.tensor(2.0)} for i in range(3)]
    whole = concat_microbatches(mbs, [2, 2, 2])
    assert whole["logits"].shape == (6, 3) and whole["logits"][4, 0] == 2.0
    assert whole["n"] == 7 and whole["scale"] == 2.0
    uneven = concat_microbatches([torch.zeros(3, 2), torch.ones(2, 2)], [3, 2])  # a smaller last batch
    assert uneven.shape == (5, 2) and uneven[3:].eq(1).all()
    assert concat_microbatches([("tag", None), ("tag", None)], [2, 2]) == ("tag", None)
    with pytest.raises(PipelineRuntimeError, match=r"output leaf 0 is a tensor of shape \(\).*no whole-batch value"):
        concat_microbatches([torch.tensor(1.0), torch.tensor(2.0)], [2, 2])


def test_modes_keep_the_error_and_check_module_modes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    error = PlanError("cannot place node 'x'")
    modes = Modes(model=model, workers={}, derived=error, make_worker=None,  # type: ignore[arg-type]
                  device=torch.device("cpu"))
    assert modes.captured_training and modes.workers(True) == {}
    with pytest.raises(PlanError, match="cannot place node 'x'"):
        modes.workers(False)  # only the mode that cannot run refuses
    modes.check(True)
    model[1].eval()  # by hand: the captured train graph would ignore it
    with pytest.raises(InputError, match=r"module '1' is in eval mode, but the pipeline's train-mode graph"):
        modes.check(True)
    modes.set(True)
    modes.check(True)


def test_both_modes_hold_the_same_tensors_after_a_device_move() -> None:
    """``.to(cuda)`` gives moved buffers new tensor objects; the eval programs must then read
    the very tensors that training updates (simulated here by replacing them on the CPU)."""
    torch.manual_seed(0)
    model, x = FunctionalDropout(), torch.randn(8, 16)
    plan = _plan(model, x, CaptureMethod.EXPORT)
    _, first = first_microbatch((x,), 2)
    captured = capture(model, first, method=CaptureMethod.EXPORT)
    derived = derive_other_mode(model, first, captured, plan, ())
    workers = {}
    for stage in range(2):
        program = split_stage(captured.gm, plan, stage)
        for owner in program.module.modules():
            for name, b in list(owner._buffers.items()):
                owner._buffers[name] = b.clone()  # what a device move does to buffers
        workers[stage] = _worker(program, plan, captured.unflatten_output)
    modes = Modes(model=model, workers=workers, derived=derived, make_worker=_worker, device=torch.device("cpu"))
    for stage in range(2):
        train_state = dict(workers[stage].program.module.named_buffers())
        eval_state = dict(modes.workers(False)[stage].program.module.named_buffers())
        assert any(n.endswith("running_mean") for n in train_state) or stage == 0
        assert all(eval_state[n] is t for n, t in train_state.items() if n in eval_state)
        assert set(eval_state) <= set(train_state)


def _worker(program, plan, unflatten):  # type: ignore[no-untyped-def]
    return StageWorker(program, plan, rank=program.index, ranks=[0, 1], group=None, device=torch.device("cpu"),
                       loss_fn=lambda o, t: o.sum(), unflatten_output=unflatten,
                       timeout=datetime.timedelta(seconds=1))
