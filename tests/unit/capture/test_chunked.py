"""``as_planned``: the graph a plan with chunked nodes runs, shared by compile, the other
train/eval mode and calibration; the other mode's graph is rewritten the same way."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pipecut.capture import as_planned, capture, fingerprint
from pipecut.capture.modes import derive_other_mode, describe_graph
from pipecut.core.kinds import CaptureMethod
from pipecut.ir import ChunkedNode
from pipecut.passes.partition.chain import is_unit
from pipecut.passes.partition.solve import partition_costs
from pipecut.passes.rewrite.split import split

CHUNKS = (ChunkedNode(node="head", pieces=3),)


class DropoutLM(nn.Module):
    """An embedding, dropout (so eval mode captures another graph) and a heavy head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.drop = nn.Dropout(0.5)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.drop(self.emb(idx))).relu())


def test_nothing_chunked_is_the_same_capture() -> None:
    model = DropoutLM()
    captured = capture(model, (torch.zeros(2, 6, dtype=torch.long),))
    assert as_planned(captured, ()) is captured


def test_the_rewritten_capture_keeps_inputs_state_and_results() -> None:
    torch.manual_seed(0)
    model = DropoutLM().eval()
    idx = torch.randint(0, 64, (2, 6))
    captured = capture(model, (idx,))
    planned = as_planned(captured, CHUNKS)
    assert planned.input_names == captured.input_names and planned.method is captured.method
    assert planned.names == captured.names
    assert {id(p) for p in planned.gm.parameters()} == {id(p) for p in model.parameters()}
    assert fingerprint(planned.gm) != fingerprint(captured.gm)
    assert fingerprint(as_planned(captured, CHUNKS).gm) == fingerprint(planned.gm)  # deterministic
    torch.testing.assert_close(planned.gm(idx), model(idx), rtol=1e-5, atol=1e-6)


def test_the_other_mode_is_rewritten_as_the_plan_says() -> None:
    torch.manual_seed(0)
    model = DropoutLM()  # training: export's eval graph differs (dropout's train flag)
    idx = torch.randint(0, 64, (2, 6))
    chunks = (ChunkedNode(node="linear_1", pieces=3),)  # export names the head by op counter
    captured = as_planned(capture(model, (idx,), method=CaptureMethod.EXPORT), chunks)
    rows = tuple(dataclasses.replace(n, forward_ms=1.0) if is_unit(n) else n
                 for n in describe_graph(captured, [idx]))
    plan = dataclasses.replace(
        partition_costs(rows, devices=3, microbatches=1, batch_size=2, inputs=captured.input_names),
        chunked=chunks)
    derived = derive_other_mode(model, (idx,), captured, plan, ())
    assert derived is not None
    other, other_plan = derived
    assert other_plan.chunked == chunks
    names = {n.name for n in other.gm.graph.nodes}
    assert {"linear_1_piece0", "linear_1_piece1", "linear_1_piece2", "linear_1"} <= names
    assert {s.index for s in other_plan.stages if "linear_1_piece2" in s.nodes} == {
        s.index for s in plan.stages if "linear_1_piece2" in s.nodes}
    # the eval stages, run in order, compute the eval model
    values: tuple = ()
    for prog in split(other.gm, other_plan):
        values = prog.module(*values, *[idx for _ in prog.model_inputs])
    with torch.no_grad():
        expected = model.eval()(idx)
    torch.testing.assert_close(other.unflatten_output(values), expected, rtol=1e-5, atol=1e-6)
