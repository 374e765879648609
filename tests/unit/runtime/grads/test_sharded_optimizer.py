"""pipecut.runtime.grads.sharded_optimizer: which optimizer each data-parallel kind gets, and
ZeRO-1's optimizer on one process (the replicas' sharding at parity: tests/multiprocess/test_sharded_optimizer.py)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipecut.core.kinds import DataParallelKind
from pipecut.errors import InputError
from pipecut.runtime.grads.sharded_optimizer import ShardedStateOptimizer, make_optimizer


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    """A default process group of one rank (gloo, a FileStore), torn down after the test."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        group = dist.group.WORLD
        assert group is not None
        yield group
    finally:
        dist.destroy_process_group()


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


@pytest.mark.parametrize("kind", [None, DataParallelKind.DDP, DataParallelKind.FSDP])
def test_other_kinds_get_the_optimizer_class_itself(kind: DataParallelKind | None) -> None:
    opt = make_optimizer(_params(), torch.optim.AdamW, kind, None, lr=0.5, weight_decay=0.0)
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["lr"] == 0.5 and opt.defaults["weight_decay"] == 0.0


def test_zero1_without_replicas_is_refused() -> None:
    with pytest.raises(InputError, match="data_parallel='zero1' needs replicas"):
        make_optimizer(_params(), torch.optim.AdamW, DataParallelKind.ZERO1, None, lr=0.1)


def test_zero1_steps_as_the_optimizer_it_wraps(one_rank: dist.ProcessGroup) -> None:
    """One replica owns every parameter; its updates are AdamW's, and ``zero_grad`` clears the
    gradients of the tensors it was given."""
    mine, plain = _params(), _params()
    opt = make_optimizer(mine, torch.optim.AdamW, DataParallelKind.ZERO1, one_rank, lr=0.1, weight_decay=0.1)
    ref = torch.optim.AdamW(plain, lr=0.1, weight_decay=0.1)
    assert isinstance(opt, ShardedStateOptimizer)
    assert opt.owned() == (0, 1) and list(opt.held) == mine
    for _ in range(3):
        for p, q in zip(mine, plain):
            g = torch.full_like(p, 0.3) + p.detach()
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for p, q in zip(mine, plain):
            torch.testing.assert_close(p, q, rtol=0, atol=0)  # the same kernels on the same tensors
            assert p.grad is None


def test_zero1_param_groups_keep_their_options(one_rank: dist.ProcessGroup) -> None:
    a, b = _params()
    opt = make_optimizer([{"params": [a], "weight_decay": 0.0}, {"params": [b]}], torch.optim.AdamW,
                         DataParallelKind.ZERO1, one_rank, lr=0.1, weight_decay=0.2)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.2]


def test_zero1_with_no_parameters_is_refused(one_rank: dist.ProcessGroup) -> None:
    with pytest.raises(InputError, match="got no parameters"):
        make_optimizer([], torch.optim.AdamW, DataParallelKind.ZERO1, one_rank, lr=0.1)


def _dtensor(one_rank: dist.ProcessGroup) -> torch.nn.Parameter:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    return torch.nn.Parameter(distribute_tensor(_params()[0].detach(), mesh, [Shard(0)]))


def test_zero1_updates_a_dtensor_through_its_local_shard(one_rank: dist.ProcessGroup) -> None:
    p, (q, _) = _dtensor(one_rank), _params()
    opt = make_optimizer([p], torch.optim.AdamW, DataParallelKind.ZERO1, one_rank, lr=0.1)
    ref = torch.optim.AdamW([q], lr=0.1)
    for _ in range(2):
        g = torch.full_like(q, 0.3) + q.detach()
        p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
        q.grad = g.clone()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=0)
        assert p.grad is None


def test_zero1_refuses_a_non_elementwise_optimizer_on_dtensors(one_rank: dist.ProcessGroup) -> None:
    """Adafactor factors a matrix's second moment by rows and columns: on a shard it would
    factor the shard's rows, not the parameter's."""
    with pytest.raises(InputError, match=r"exact only for an elementwise update .* not Adafactor"):
        make_optimizer([_dtensor(one_rank)], torch.optim.Adafactor, DataParallelKind.ZERO1, one_rank, lr=0.1)
