"""Running one node at a time: state is restored, leaves are fresh, cut values keep their grad."""

from __future__ import annotations

import torch
from torch import nn

from pipecut.profile.running import NodeRunner, cut, detached_leaves, preserved_state


def test_preserved_state_restores_buffers_and_rng() -> None:
    bn = nn.BatchNorm1d(4)
    rng = torch.get_rng_state()
    with preserved_state(bn):
        bn(torch.randn(8, 4))
        torch.rand(3)
    assert torch.equal(bn.running_mean, torch.zeros(4)) and int(bn.num_batches_tracked) == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_detached_leaves_are_fresh_and_cloned_for_in_place_nodes() -> None:
    x = torch.randn(3, requires_grad=True) * 2  # not a leaf
    ones = torch.ones(2)
    (tree, plain), leaves = detached_leaves((x, ones))
    assert len(leaves) == 1 and leaves[0].is_leaf and tree is leaves[0] and plain is ones
    (copied, _), _ = detached_leaves((x, torch.ones(2)), clone=True)
    assert copied is not leaves[0] and copied.data_ptr() != x.data_ptr()


def test_cut_drops_history_but_keeps_requires_grad() -> None:
    x = torch.randn(3, requires_grad=True) * 2
    y = cut(x)
    assert y.requires_grad and y.grad_fn is not None and y.grad_fn.next_functions[0][0] is not x.grad_fn
    assert cut(torch.ones(2)).requires_grad is False and cut(5) == 5


def test_node_runner_runs_one_node_on_given_arguments() -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU()))
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    out = NodeRunner(gm).call(node, (torch.tensor([-1.0, 2.0]),), {})
    assert torch.equal(out, torch.tensor([0.0, 2.0]))
