"""A stage's parameters as DTensors (``shard_module``), the two ends of a split region and the
token shards' wire (``TokenWire``), on a one-rank gloo group (the numbers over two and more ranks are tests/multiprocess/test_tensor_parallel.py)."""

from __future__ import annotations

import types

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from pipecut.core.kinds import LeafKind, NodeOp
from pipecut.ir import Leaf, NodeCost
from pipecut.runtime.comm.wire import WireSpec
from pipecut.runtime.execution.tensor_parallel import (
    TokenWire,
    local_heads,
    region_ends,
    shard_module,
    whole,
)


@pytest.fixture
def mesh(one_rank_mesh: object) -> object:
    return one_rank_mesh


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


def _cut(*shapes: tuple[int, ...]) -> WireSpec:
    leaves = [NodeCost(name=f"v{i}", op=NodeOp.CALL_FUNCTION, target="add",
                       leaves=(Leaf(kind=LeafKind.TENSOR, shape=shape, dtype="float32", requires_grad=True),))
              for i, shape in enumerate(shapes)]
    return WireSpec(tuple(leaves))


def test_token_values_travel_as_a_groups_share_of_their_tokens_where_it_divides_them() -> None:
    two = types.SimpleNamespace(size=lambda: 2)  # the rule reads the group size only
    spec = _cut((2, 16, 64), (2, 15, 64), (16,), (2, 16, 64))
    wire = TokenWire(two, frozenset({"v0", "v1", "v2"}))  # type: ignore[arg-type]
    shapes = [wire.shape(spec, leaf) for leaf in spec.tensors]
    # tokens split in two; 15 tokens and a 1-D value travel whole; v3 is not a token value
    assert shapes == [(2, 8, 64), (2, 15, 64), (16,), (2, 16, 64)]


def test_token_shards_leave_as_local_tensors_and_arrive_as_the_same_shard(mesh) -> None:
    spec = _cut((2, 4, 3), (2, 4, 3))
    wire = TokenWire(mesh, frozenset({"v0"}))
    x = torch.randn(2, 4, 3, requires_grad=True)
    shard = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
    plain = torch.randn(2, 4, 3)
    sent = wire.depart([shard * 2, plain], spec)
    assert not isinstance(sent[0], DTensor) and sent[1] is plain
    arrived = wire.arrive([sent[0], plain], spec)
    assert isinstance(arrived[0], DTensor) and arrived[0].placements == (Shard(1),) and arrived[1] is plain
    torch.testing.assert_close(arrived[0].full_tensor(), 2 * x)
    arrived[0].full_tensor().sum().backward()  # differentiable across both ends
    torch.testing.assert_close(x.grad, torch.full((2, 4, 3), 2.0))


@pytest.mark.parametrize("mask", ["none", "broadcast", "per head"])
def test_local_heads_runs_attention_on_the_local_heads_and_carries_gradients(mesh, mask: str) -> None:
    """On one rank every head is local: the result and the gradients are plain SDPA's, the output
    keeps the heads' split, and grouped-query attention (4 query over 2 key/value heads) holds."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(2))
    masks = {"none": None, "broadcast": torch.rand(2, 1, 5, 5) > 0.3, "per head": torch.rand(2, 4, 5, 5) > 0.3}
    m = masks[mask]
    if m is not None:
        m[..., 0] = True  # no row fully masked
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = sdpa(q, k, v, m, enable_gqa=True)
    want.square().sum().backward()
    expected = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    shard = [Shard(1)]
    dq, dk, dv = (DTensor.from_local(t, mesh, shard, run_check=False) for t in (q, k, v))
    got = local_heads(sdpa)(dq, dk, dv, m, enable_gqa=True)
    assert isinstance(got, DTensor) and got.placements == (Shard(1),)
    torch.testing.assert_close(got.full_tensor(), want)
    got.full_tensor().square().sum().backward()
    for t, g in zip((q, k, v), expected):
        torch.testing.assert_close(t.grad, g)


def test_local_heads_runs_whole_heads_replicated_where_the_split_is_not_the_heads(mesh) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    tokens = DTensor.from_local(q, mesh, [Shard(2)], run_check=False)  # split along the tokens
    got = local_heads(sdpa)(tokens, k, v)
    assert got.placements == (Replicate(),)
    torch.testing.assert_close(got.full_tensor(), sdpa(q, k, v))
    torch.testing.assert_close(local_heads(sdpa)(q, k, v), sdpa(q, k, v))  # plain tensors: the op itself


@pytest.mark.parametrize("split", ["dtensor", "plain"])
def test_local_heads_refuses_a_mask_that_does_not_cover_the_tokens_it_holds(mesh, split: str) -> None:
    """A query of 8 tokens (a token shard taken for the whole) against the whole sequence's mask
    of 16: refused in words before the kernel (which raised 'The expanded size of the tensor (8)
    must match the existing size (16)'), as the build's probe needs to name the node."""
    from pipecut.runtime.execution.tensor_parallel import AttentionSplitError

    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(2, 4, 8, 8)
    k, v = (torch.randn(2, 4, 16, 8) for _ in range(2))
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
    if split == "dtensor":
        q, k, v = (DTensor.from_local(t, mesh, [Shard(1)], run_check=False) for t in (q, k, v))
    with pytest.raises(AttentionSplitError, match=r"covers 16 queries x 16 keys, but this rank holds 8 queries"):
        local_heads(sdpa)(q, k, v, mask)
    local_heads(sdpa)(q, k, v, mask[..., :1, :])  # a mask broadcast over the queries covers any count


def test_whole_makes_every_dtensor_of_a_returned_tuple_plain(mesh) -> None:
    """A stage that returns a split region's ``chunk`` returns a tuple of DTensors (Phi-3 under
    ZBV): each is made whole, else it reached the send as a DTensor."""
    x = torch.randn(2, 4, 6)
    halves = DTensor.from_local(x, mesh, [Replicate()], run_check=False).chunk(2, dim=-1)
    got = whole([halves, 3])
    assert not any(isinstance(t, DTensor) for t in (*got[0], got[1]))
    torch.testing.assert_close(torch.cat(got[0], dim=-1), x)
    assert got[1] == 3
