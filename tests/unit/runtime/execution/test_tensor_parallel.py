"""A stage's parameters as DTensors (``shard_module``) and the two ends of a split region, on a
one-rank gloo group (the numbers over two and more ranks are tests/dist/test_tensor_parallel.py)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from pipecut.runtime.execution.tensor_parallel import region_ends, shard_module, whole


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[object]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_split_parameters_become_dtensors_on_a_copy_and_tied_names_stay_one(mesh) -> None:
    torch.manual_seed(0)
    up, down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
    stage = torch.nn.Sequential(up, down)
    stage.tied = down  # a second name for down's weight, as a tied head would be
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    shard_module(stage, {"0.weight": 0, "1.weight": 1, "tied.weight": 1}, mesh, replicated=("0.bias",))
    params = dict(stage.named_parameters(remove_duplicate=False))
    assert isinstance(params["0.weight"], DTensor) and params["0.weight"].placements == (Shard(0),)
    assert params["1.weight"].placements == (Shard(1),) and params["0.bias"].placements == (Replicate(),)
    assert params["1.weight"] is params["tied.weight"]  # one parameter under both names
    assert not isinstance(params["1.bias"], DTensor)  # not named: plain and whole
    for name, value in before.items():
        torch.testing.assert_close(whole(params[name]), value, rtol=0, atol=0)
    # the modules it called are copies: the originals (the captured graph's) keep plain tensors
    assert not isinstance(up.weight, DTensor) and not isinstance(down.weight, DTensor)


def test_region_ends_view_a_plain_value_as_replicated_and_make_it_plain_again(mesh) -> None:
    ends = region_ends(mesh)
    enter, leave = ends.enter, ends.leave
    x = torch.randn(3, 4, requires_grad=True)
    inside = enter(x)
    assert isinstance(inside, DTensor) and inside.placements == (Replicate(),)
    out = leave(inside * 2)
    assert not isinstance(out, DTensor)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3, 4), 2.0))
    assert enter("not a tensor") == "not a tensor" and leave(x) is x


def test_sequence_parallel_ends_cut_the_tokens_gather_them_and_join_plain_values(mesh) -> None:
    ends = region_ends(mesh, sequence_parallel=True)
    assert ends.join is not None
    x = torch.randn(2, 3, 4, requires_grad=True)
    inside = ends.enter(x)
    assert isinstance(inside, DTensor) and inside.placements == (Replicate(),)
    shard = ends.leave(inside * 2)  # (batch, tokens, features): split along the tokens
    assert isinstance(shard, DTensor) and shard.placements == (Shard(1),)
    assert ends.leave(ends.enter(torch.randn(6, 4))).placements == (Shard(0),)  # (tokens, features)
    assert ends.enter(shard).placements == (Replicate(),)  # gathered where a region reads it
    assert ends.join(shard) is shard and ends.join(x).placements == (Replicate(),)
    assert ends.join(7) == 7 and ends.whole(x) is x
    out = ends.whole(ends.join(shard) + ends.join(torch.ones(2, 3, 4)))
    assert not isinstance(out, DTensor)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 3, 4), 2.0))
