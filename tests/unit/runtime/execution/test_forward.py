"""pipecut.runtime.execution.forward: whole-batch outputs of forward-only steps, and gradient flags on the wire."""

from __future__ import annotations

import pytest
import torch

from pipecut.errors import PipelineRuntimeError
from pipecut.runtime.comm.wire import WireSpec
from pipecut.runtime.execution.forward import check_grad_flags, concat_microbatches
from tests.unit.tiny import mlp_plan


def test_outputs_concatenate_along_the_batch_and_keep_equal_constants():
    a = {"logits": torch.zeros(2, 3), "n": 4, "scale": torch.tensor(2.0), "mask": torch.ones(5)}
    b = {"logits": torch.ones(1, 3), "n": 4, "scale": torch.tensor(2.0), "mask": torch.ones(5)}
    out = concat_microbatches([a, b], [2, 1])
    assert out["logits"].tolist() == [[0.0] * 3, [0.0] * 3, [1.0] * 3]
    assert out["n"] == 4 and out["scale"].item() == 2.0 and out["mask"].shape == (5,)


def test_outputs_without_a_whole_batch_value_are_refused():
    with pytest.raises(PipelineRuntimeError, match="output leaf 0 is a tensor of shape \\(\\): it has no batch dimension of size 2"):
        concat_microbatches([torch.tensor(1.0), torch.tensor(2.0)], [2, 2])
    with pytest.raises(PipelineRuntimeError, match=r"output leaf 1 is 3: .* return per-sample values"):
        concat_microbatches([(torch.zeros(2), 3), (torch.zeros(2), 4)], [2, 2])
    with pytest.raises(PipelineRuntimeError, match="microbatch 1's output is structured as"):
        concat_microbatches([(torch.zeros(2),), [torch.zeros(2)]], [2, 2])


def test_sent_tensors_must_require_grad_as_planned():
    plan = mlp_plan()
    name = plan.stages[0].outputs[0]
    spec = WireSpec(values=(plan.node(name),))
    leaf = spec.tensors[0]
    assert leaf.requires_grad
    check_grad_flags([torch.zeros(leaf.shape, requires_grad=True)], spec, 0)
    with pytest.raises(PipelineRuntimeError, match=f"stage 0: value '{name}' \\(leaf 0\\) does not require grad, "
                                                   "but the plan was made when it did"):
        check_grad_flags([torch.zeros(leaf.shape)], spec, 0)
