"""Which parameters a tensor-parallel stage splits (``pipecut.assemble.tensor.tensor_shards``): the
user's split, else the model's own ``tp_plan``, else the graph's column/row pairs. The split at
run time and its numbers against the plain model are in tests/multiprocess/test_tensor_parallel.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from pipecut.assemble.tensor import model_tp_plan, tensor_shards
from pipecut.core.kinds import TensorShard
from pipecut.options import TensorParallelOptions
from pipecut.passes.parallel.tensor import ParameterShard
from tests.unit.tiny import _mlp, mlp_plan

COLUMN, ROW = ParameterShard(kind=TensorShard.COLUMN, dim=0), ParameterShard(kind=TensorShard.ROW, dim=1)


def test_the_graph_pairs_column_then_row_products() -> None:
    model, _, _, _ = _mlp()  # Linear, ReLU blocks, then a head: up to nothing that reduces
    shards = tensor_shards(model, mlp_plan(2), TensorParallelOptions())
    assert shards["layers.0.0.weight"] == COLUMN and shards["layers.0.0.bias"] == COLUMN
    assert shards["layers.1.0.weight"] == ROW and "layers.1.0.bias" not in shards  # added after the reduction
    assert shards["layers.2.0.weight"] == COLUMN and shards["layers.3.0.weight"] == ROW


def test_a_users_split_is_the_whole_split() -> None:
    model, _, _, _ = _mlp()
    asked = TensorParallelOptions(plan={"layers.*.0": "column", "head": "replicated"})
    shards = tensor_shards(model, mlp_plan(2), asked)
    assert set(shards) == {f"layers.{i}.0.{leaf}" for i in range(4) for leaf in ("weight", "bias")}
    assert all(s == COLUMN for s in shards.values())


def test_a_models_own_tp_plan_wins_over_the_graph() -> None:
    model, _, _, _ = _mlp()
    model.tp_plan = {"layers.0.0": "colwise", "layers.1.0": "rowwise", "layers.2.0": "colwise_rep"}
    assert model_tp_plan(model) == model.tp_plan
    shards = tensor_shards(model, mlp_plan(2), TensorParallelOptions())
    # a style that is not a plain split (colwise_rep gathers its output) leaves the module whole
    assert shards == {"layers.0.0.weight": COLUMN, "layers.0.0.bias": COLUMN, "layers.1.0.weight": ROW}


def test_a_hugging_face_config_plan_is_read_under_the_base_models_prefix() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    styles = model_tp_plan(model)
    assert styles["model.layers.*.self_attn.q_proj"] == "colwise"
    assert styles["model.layers.*.self_attn.o_proj"] == "rowwise"


def test_the_build_probe_refuses_dtensors_own_failures_and_leaves_a_kernels_to_the_step(one_rank_mesh: Any) -> None:
    """What DTensor's code raises (no sharding rule for an op) is refused at build, and so is an
    attention whose mask does not cover the tokens a rank holds; what a kernel
    raises on the probe's made-up values (an index out of range), even called by DTensor, is not
    DTensor's, and neither is the model's own error, whatever its type or words."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from pipecut.assemble.tensor import _split_failure
    from pipecut.runtime.execution.tensor_parallel import local_heads

    def models_own() -> None:
        raise NotImplementedError("this DTensor placement is not handled by the model")

    x = DTensor.from_local(torch.randn(4, 3), one_rank_mesh, [Shard(0)], run_check=False)
    index = DTensor.from_local(torch.tensor([9]), one_rank_mesh, [Replicate()], run_check=False)
    failures = []
    q = torch.randn(1, 2, 8, 4)
    whole_mask = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    for run in (lambda: torch.renorm(x, 2, 0, 1.0),
                lambda: local_heads(torch.nn.functional.scaled_dot_product_attention)(q, q, q, whole_mask),
                lambda: torch.index_select(x.redistribute(one_rank_mesh, [Replicate()]), 0, index),
                lambda: int("nine"), models_own):
        with pytest.raises(Exception) as caught:
            run()
        failures.append(_split_failure(caught.value))
    assert failures == [True, True, False, False, False]



def refused(x: torch.Tensor) -> torch.Tensor:
    """An op that fails when run (as DTensor fails one without a sharding rule): a leaf of the trace."""
    raise NotImplementedError("no sharding strategy")


torch.fx.wrap("refused")


def test_the_probe_names_the_node_inside_a_recomputed_run_that_fails() -> None:
    """A stage with selective recompute holds its recomputed runs as segments: the node an
    error names is the op inside the run, not the segment (whose name says nothing of it)."""
    import torch.fx as fx

    from pipecut.assemble.tensor import _Tracing
    from pipecut.passes.rewrite.segments import checkpoint_segments

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(refused(self.lin(x)))

    gm = fx.symbolic_trace(Net())
    runs = checkpoint_segments(gm, ("lin", "refused"))
    assert [n.target for n in runs.graph.nodes if n.op == "call_module"] == ["recompute_0"]
    run = _Tracing(runs)
    with pytest.raises(NotImplementedError), torch.no_grad():
        run.run(torch.randn(2, 3))
    assert run.at is not None and run.at.name == "refused"


class _Attends(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(x, x, x)


def attention_split(x: torch.Tensor) -> torch.Tensor:
    """Attention on a token shard, as the split stage's attention refuses it: a leaf of the trace."""
    from pipecut.runtime.execution.tensor_parallel import AttentionSplitError

    raise AttentionSplitError("the mask covers 16 tokens, the query 8")


torch.fx.wrap("attention_split")


class _SplitAttends(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention_split(x) + 1


RECORDED = "recorded in the replayed plan's options"


def test_sequence_parallelism_carried_by_a_replayed_plan_is_refused_as_the_plans(one_rank_mesh: Any) -> None:
    """An attention on token shards (sequence parallelism): the fix is to leave sequence
    parallelism off where this call asked for it; where a replayed plan's options brought it,
    leaving it out would carry it again, so the fix names what to pass instead. Both refusals:
    from the graph (an attention outside every split region) and from the build's probe."""
    from types import SimpleNamespace

    from pipecut.assemble.tensor import _attention_on_tokens, _run_once
    from pipecut.errors import PlanError

    gm = torch.fx.symbolic_trace(_Attends())
    asked = _attention_on_tokens(gm, {"scaled_dot_product_attention"}, 1)
    carried = _attention_on_tokens(gm, {"scaled_dot_product_attention"}, 1, RECORDED)
    assert asked is not None and carried is not None
    assert re.search(r"^stage 1 \(rank 0\) cannot run split .* are not split\. Leave "
                     r"TensorParallelOptions\(sequence_parallel=False\), or split those projections", str(asked))
    assert re.search(r"are not split\. Pass tensor_parallel=TensorParallelOptions\(sequence_parallel=False\) \(sequence "
                     r"parallelism here is recorded in the replayed plan's options; give its plan= too, if it records "
                     r"one\), or split those projections", str(carried))
    probe = torch.fx.symbolic_trace(_SplitAttends())
    worker: Any = SimpleNamespace(prev=None, program=SimpleNamespace(model_inputs=["x"]))
    with pytest.raises(PlanError, match=r"node attention_split .*, on the residual stream's token shards \(sequence "
                                        r"parallelism\), failed on DTensors: AttentionSplitError: .*\. leave "
                                        r"TensorParallelOptions\(sequence_parallel=False\), keep the parameters"):
        _run_once(probe, worker, {"x": torch.ones(1, 2, 4, 4)}, 0, {"attention_split"})
    with pytest.raises(PlanError, match=r"failed on DTensors: AttentionSplitError: .*\. pass "
                                        r"tensor_parallel=TensorParallelOptions\(sequence_parallel=False\) \(sequence "
                                        r"parallelism here is recorded in the replayed plan's options; .*\), keep the "
                                        r"parameters it reads whole"):
        _run_once(probe, worker, {"x": torch.ones(1, 2, 4, 4)}, 0, {"attention_split"}, RECORDED)
