"""pipecut.runtime.execution.executor: a rank runs its communication program.

Three ranks run as threads of this process; ``torch.distributed``'s point-to-point calls are
replaced by mailboxes (one FIFO per sender, receiver and tag, as gloo matches them), so the
executor's issue/wait/drain logic runs for real and a deadlock would show as a timeout.
"""

from __future__ import annotations

import collections
import datetime
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from examples import mlp
from pipecut.passes.costs.stages import plan_schedule
from pipecut.passes.rewrite.split import split
from pipecut.runtime.comm.p2p import comm_program, wiring
from pipecut.runtime.execution.executor import run_actions
from pipecut.runtime.execution.stage import StageWorker
from tests.unit.tiny import mlp_captured, mlp_plan


class Mailboxes:
    def __init__(self) -> None:
        self.boxes: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.cond = threading.Condition()
        self.local = threading.local()

    def op(self, fn, tensor, peer, group=None, tag=0):  # stands in for dist.P2POp
        return SimpleNamespace(op=fn, tensor=tensor, peer=peer, tag=tag)

    def batch(self, ops):  # stands in for dist.batch_isend_irecv
        me = self.local.rank
        works = []
        for op in ops:
            tensor, peer, tag = op.tensor, op.peer, op.tag
            if op.op is dist.isend:
                with self.cond:
                    self.boxes[(me, peer, tag)].append(tensor.clone())
                    self.cond.notify_all()
                works.append(_Done())
            else:
                works.append(_Recv(self, (peer, me, tag), tensor))
        return works


class _Done:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class _Recv(_Done):
    def __init__(self, boxes, key, buffer):
        self.boxes, self.key, self.buffer = boxes, key, buffer

    def wait(self, timeout=None):
        with self.boxes.cond:
            if not self.boxes.cond.wait_for(lambda: self.boxes.boxes[self.key], timeout=10):
                raise RuntimeError(f"timed out waiting for {self.key}")
            self.buffer.copy_(self.boxes.boxes[self.key].popleft())
        return True


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_three_ranks_train_like_the_plain_model(monkeypatch, schedule):
    boxes = Mailboxes()
    monkeypatch.setattr(dist, "P2POp", boxes.op)
    monkeypatch.setattr(dist, "batch_isend_irecv", boxes.batch)
    plan, captured = mlp_plan(schedule=schedule), mlp_captured()
    captured.gm.zero_grad(set_to_none=True)
    _, (x,), loss_fn, y = mlp.build(batch_size=8, width=32, depth=4)
    m = plan.microbatches
    inputs, targets = [{"x": c} for c in x.chunk(m)], list(y.chunk(m))
    sched, w = plan_schedule(plan), wiring(plan)
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        boxes.local.rank = r
        program = split(captured.gm, plan)[r]
        worker = StageWorker(program, plan, rank=r, ranks=[0, 1, 2], group=None, device=torch.device("cpu"),
                             loss_fn=loss_fn, unflatten_output=captured.unflatten_output,
                             timeout=datetime.timedelta(seconds=10))
        try:
            results[r] = run_actions({r: worker}, comm_program(sched, r, w), inputs, targets, record=True)
        except BaseException as e:
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [v for v in results.values() if isinstance(v, BaseException)]
    assert not errors, errors
    (loss0, events0), (loss2, events2) = results[0], results[2]
    assert loss0 is None
    assert [e.action for e in events0] == [str(a) for a in sched[0]]
    assert all(e.start <= e.end for e in events2)
    model, _, _, _ = mlp.build(batch_size=8, width=32, depth=4)
    want = loss_fn(model(x), y)
    want.backward()
    assert loss2.item() == pytest.approx(want.item(), rel=1e-5)
    got = dict(captured.gm.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(got[name].grad, p.grad, atol=1e-6), name
    captured.gm.zero_grad(set_to_none=True)
