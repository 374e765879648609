"""pipecut.runtime.execution.stage: a stage worker's forward and backward, wired by hand in one process.

The executor and the process group are replaced by moving each worker's outbox into its
neighbour's inbox, so a whole GPipe step runs here and is compared with the plain model.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from examples import mlp
from pipecut.errors import PipelineRuntimeError
from pipecut.passes.rewrite.split import split
from pipecut.runtime.comm.p2p import Direction, Op, Transfer
from pipecut.runtime.execution.stage import StageWorker, tree_to
from tests.unit.tiny import mlp_captured, mlp_plan


def workers(loss_fn=torch.nn.functional.cross_entropy):
    plan, captured = mlp_plan(), mlp_captured()
    captured.gm.zero_grad(set_to_none=True)  # the stages hold the captured graph's parameters
    out = []
    for program in split(captured.gm, plan):
        out.append(StageWorker(program, plan, rank=program.index, ranks=list(range(plan.num_ranks)), group=None,
                               device=torch.device("cpu"), loss_fn=loss_fn,
                               unflatten_output=captured.unflatten_output, timeout=datetime.timedelta(seconds=1)))
    return plan, captured, out


def carry(src: StageWorker, dst: StageWorker, direction: Direction) -> None:
    for (d, mb, leaf) in [k for k in src.outbox if k[0] is direction]:
        dst.inbox.setdefault((d, mb), {})[leaf] = src.outbox.pop((d, mb, leaf)).clone()


def test_a_gpipe_step_by_hand_gives_the_plain_models_loss_and_gradients():
    plan, captured, ws = workers()
    _, (x,), loss_fn, y = mlp.build(batch_size=8, width=32, depth=4)
    m = plan.microbatches
    xs, ys = x.chunk(m), y.chunk(m)
    for w in ws:
        w.begin()
    for mb in range(m):
        for s, w in enumerate(ws):
            w.forward(mb, {"x": xs[mb]} if "x" in w.program.model_inputs else {}, ys[mb])
            if s + 1 < len(ws):
                carry(w, ws[s + 1], Direction.FORWARD)
    for mb in reversed(range(m)):
        for s in reversed(range(len(ws))):
            ws[s].backward(mb)
            if s:
                carry(ws[s], ws[s - 1], Direction.BACKWARD)
    for w in ws:
        w.check_all_sent()
    assert ws[0].loss() is None
    grads = {n: p.grad.clone() for w in ws for n, p in w.program.module.named_parameters()}
    captured.gm.zero_grad(set_to_none=True)
    model, _, _, _ = mlp.build(batch_size=8, width=32, depth=4)
    want = loss_fn(model(x), y)
    want.backward()
    assert ws[-1].loss().item() == pytest.approx(want.item(), rel=1e-5)
    expected = dict(model.named_parameters())
    assert set(grads) == set(expected)
    for name, g in grads.items():
        assert torch.allclose(g, expected[name].grad, atol=1e-6), name


def test_the_last_stage_needs_a_scalar_loss():
    with pytest.raises(PipelineRuntimeError, match="the last stage needs a loss_fn"):
        workers(loss_fn=None)
    _, _, ws = workers(loss_fn=lambda out, target: out)  # not reduced
    last = ws[-1]
    last.inbox[(Direction.FORWARD, 0)] = {0: torch.zeros(2, 32)}
    with pytest.raises(PipelineRuntimeError, match=r"stage 2: loss_fn must return a scalar tensor, got torch.Size\(\[2, 10\]\); reduce it"):
        last.forward(0, {}, None)


def test_wiring_mismatches_name_the_stage():
    _, _, ws = workers()
    with pytest.raises(PipelineRuntimeError, match="stage 1: microbatch 0 needs 1 forward tensors, 0 were received"):
        ws[1].forward(0, {}, None)
    with pytest.raises(PipelineRuntimeError, match="stage 0 has no neighbour across cut 0"):
        ws[0].p2p_op(Transfer(Op.RECV, 0, 0, 0, Direction.FORWARD, 0, 0))
    ws[0].forward(0, {"x": torch.zeros(2, 32)}, None)
    with pytest.raises(PipelineRuntimeError, match=r"stage 0: tensors computed but never sent: \['F0.0'\]"):
        ws[0].check_all_sent()
    with pytest.raises(PipelineRuntimeError, match="stage 0: 0W runs before 0I"):
        ws[0].backward_weight(0)


def test_tree_to_moves_every_tensor():
    out = tree_to({"a": torch.zeros(1, dtype=torch.float64), "n": 1}, torch.device("meta"))
    assert out["a"].device.type == "meta" and out["n"] == 1
