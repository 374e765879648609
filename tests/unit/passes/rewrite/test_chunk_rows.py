"""The row-chunk pass: every linear-like form the captures produce gives the original's output
and gradients, the input graph is untouched, names are deterministic, and what cannot be
chunked is refused by name.

Tolerances: each output row is the same dot products as before (equal up to the kernel's
blocking), but a weight gradient sums over rows, and the pieces sum their rows separately before
autograd adds the pieces: float32 sums in another order, so rtol 1e-5 / atol 1e-6 (a few ulps
of sums of a few hundred terms), not equality.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from examples import gpt
from pipecut.capture import capture, fingerprint
from pipecut.core.kinds import CaptureMethod
from pipecut.errors import PlanError
from pipecut.ir import ChunkedNode
from pipecut.passes.rewrite.chunk_rows import chunk_rows, chunkable, piece_names, row_chunk

RTOL, ATOL = 1e-5, 1e-6


class Heads(nn.Module):
    """One head per form symbolic_trace records: nn.Linear, F.linear, torch.matmul, ``@``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 11)
        self.w = nn.Parameter(torch.randn(11, 8) / 3)
        self.m = nn.Parameter(torch.randn(8, 11) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + F.linear(x, self.w) + torch.matmul(x, self.m) + x @ self.w.t()


def _grads(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.detach().requires_grad_(True)
    out = module(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    for p in module.parameters():
        p.grad = None
    assert x.grad is not None
    return out.detach(), {"input": x.grad, **grads}


def _assert_same(original: nn.Module, chunked: nn.Module, x: torch.Tensor) -> None:
    out0, g0 = _grads(original, x)
    out1, g1 = _grads(chunked, x)
    torch.testing.assert_close(out1, out0, rtol=RTOL, atol=ATOL)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=RTOL, atol=ATOL, msg=name)


def test_row_chunk_covers_the_rows_in_order() -> None:
    x = torch.arange(2 * 7 * 3).reshape(2, 7, 3)
    parts = [row_chunk(x, i, 3) for i in range(3)]
    assert [p.shape[-2] for p in parts] == [3, 2, 2]
    assert torch.equal(torch.cat(parts, dim=-2), x)


@pytest.mark.parametrize("pieces", [2, 3, 5])
def test_every_traced_form_matches_and_the_input_is_untouched(pieces: int) -> None:
    torch.manual_seed(0)
    gm = fx.symbolic_trace(Heads())
    forms = [n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function") and n.name != "t"
             and "add" not in n.name]
    assert forms == ["linear", "linear_1", "matmul", "matmul_1"]  # the four forms
    before_code, before_names = gm.code, [n.name for n in gm.graph.nodes]
    chunked = chunk_rows(gm, tuple(ChunkedNode(node=f, pieces=pieces) for f in forms))
    assert gm.code == before_code and [n.name for n in gm.graph.nodes] == before_names
    names = {n.name for n in chunked.graph.nodes}
    for f in forms:
        rows, parts = piece_names(f, pieces)
        assert set(rows) | set(parts) | {f} <= names
    # the same parameter objects, not copies: training the chunked graph trains the model
    assert {id(p) for p in chunked.parameters()} == {id(p) for p in gm.parameters()}
    _assert_same(gm, chunked, torch.randn(3, 9, 8))
    _assert_same(gm, chunked, torch.randn(9, 8))  # 2-D input: rows are dim 0


def test_export_forms_match() -> None:
    class Aten(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 11, bias=False)
            self.m = nn.Parameter(torch.randn(8, 11) / 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x) + x @ self.m

    torch.manual_seed(0)
    model = Aten()
    captured = capture(model, (torch.randn(2, 6, 8),), method=CaptureMethod.EXPORT)
    gm = captured.gm
    targets = {n.name: n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert targets["linear"] is torch.ops.aten.linear.default
    assert targets["matmul"] is torch.ops.aten.matmul.default
    chunked = chunk_rows(gm, (ChunkedNode(node="linear", pieces=3), ChunkedNode(node="matmul", pieces=2)))
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(chunked(x), gm(x), rtol=RTOL, atol=ATOL)
    _assert_same(gm, chunked, x)


def test_tied_head_of_the_gpt_example_keeps_the_tie() -> None:
    model, (idx,), loss_fn, target = gpt.build(batch_size=2, vocab=96, dim=32, layers=1, seq=16)
    captured = capture(model, (idx,))
    chunked = chunk_rows(captured.gm, (ChunkedNode(node="lm_head", pieces=4),))
    assert fingerprint(chunk_rows(captured.gm, (ChunkedNode(node="lm_head", pieces=4),))) == fingerprint(chunked)
    reference = copy.deepcopy(model)
    loss0 = loss_fn(reference(idx), target)
    loss0.backward()
    loss1 = loss_fn(chunked(idx), target)
    loss1.backward()
    torch.testing.assert_close(loss1, loss0, rtol=RTOL, atol=ATOL)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():  # tok_emb.weight: embedding + every piece
        assert p.grad is not None
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=RTOL, atol=ATOL, msg=name)


def test_refusals_name_the_node_and_the_reason() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.v = nn.Parameter(torch.randn(8))
            self.norm = nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.v).unsqueeze(-1) + self.norm(x).relu() + torch.matmul(x, x.transpose(-1, -2)).sum()

    gm = fx.symbolic_trace(Odd())
    cases = {
        "nope": "has no such node",
        "relu": "not a linear-like op",
        "norm": "not an nn.Linear",
        "matmul": "not known to be a matrix",  # x @ vector drops the row dimension
        "matmul_1": "not known to be a matrix",  # a transpose of an activation: no shape known
    }
    for node, why in cases.items():
        with pytest.raises(PlanError, match=f"node {node!r}.*{why}"):
            chunk_rows(gm, (ChunkedNode(node=node, pieces=2),))
        if node != "nope":
            assert why in (chunkable(next(n for n in gm.graph.nodes if n.name == node), gm) or "")
    with pytest.raises(PlanError, match="name a node twice"):
        chunk_rows(gm, (ChunkedNode(node="relu", pieces=2), ChunkedNode(node="relu", pieces=3)))
    with pytest.raises(PlanError, match="at least 2"):
        ChunkedNode(node="relu", pieces=1)


def test_refuses_a_vector_operand_and_a_taken_name() -> None:
    class Vec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x)

    captured = capture(Vec(), (torch.randn(8),), method=CaptureMethod.EXPORT)
    with pytest.raises(PlanError, match="1 dimension"):  # export's meta: a vector, no rows
        chunk_rows(captured.gm, (ChunkedNode(node="linear", pieces=2),))

    class Taken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 4)
            self.head_piece1 = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head_piece1(self.head(x))

    gm = fx.symbolic_trace(Taken())
    with pytest.raises(PlanError, match="already has nodes named"):
        chunk_rows(gm, (ChunkedNode(node="head", pieces=2),))

    class Centred(nn.Linear):  # rows depend on each other: chunks would change the result
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x - x.mean(dim=-2, keepdim=True))

    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = Centred(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x)

    tracer = fx.Tracer()  # keep the subclass a leaf, as symbolic_trace keeps nn.Linear
    tracer.is_leaf_module = lambda m, name: isinstance(m, nn.Linear)  # type: ignore[method-assign]
    root = Own()
    gm = fx.GraphModule(root, tracer.trace(root))
    with pytest.raises(PlanError, match=r"node 'head'.*Centred, whose forward is not nn\.Linear's"):
        chunk_rows(gm, (ChunkedNode(node="head", pieces=2),))
