"""Tensor-parallel stages without processes: which parameters split (the graph's pairs, a
Hugging Face ``tp_plan``, a user's plan), where the DTensor regions open and close, and the
options that record it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

import pipecut
from pipecut.assemble.tensor import _from_styles, model_tp_plan
from pipecut.core.graph import EAGER
from pipecut.core.kinds import TensorShard
from pipecut.errors import InputError
from pipecut.ir import Plan
from pipecut.passes.parallel.tensor import ParameterShard, parameter_shards
from pipecut.passes.rewrite.tensor_regions import region_nodes, shard_regions

COLUMN, ROW, VOCAB = (ParameterShard(kind=k, dim=d) for k, d in
                      ((TensorShard.COLUMN, 0), (TensorShard.ROW, 1), (TensorShard.VOCAB, 0)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.norm(x + self.down(torch.relu(self.up(x))))


def test_regions_open_at_split_products_and_close_after_row_and_vocab_ones() -> None:
    gm = fx.symbolic_trace(Block())
    shards = {"embed.weight": VOCAB, "up.weight": COLUMN, "up.bias": COLUMN, "down.weight": ROW}
    regions = region_nodes(gm, shards)
    assert regions.inside == {"embed", "up", "relu", "down"} and regions.closing == {"embed", "down"}
    assert not regions.spread  # without sequence parallelism the residual stream stays whole

    def enter(x: object) -> object:
        return x

    def leave(x: object) -> object:
        return x

    out = shard_regions(gm, shards, enter=enter, leave=leave)
    calls = [(n.target.__name__, n.args[0].name) for n in out.graph.nodes if n.target in (enter, leave)]
    # the embedding's reduced output is plain again, viewed as replicated where up reads it
    assert calls == [("enter", "ids"), ("leave", "embed"), ("enter", "leave"), ("leave", "down")]
    assert gm.graph is not out.graph and not any(n.target in (enter, leave) for n in gm.graph.nodes)
    ids = torch.randint(0, 16, (2, 3))
    torch.testing.assert_close(out(ids), gm(ids))  # identity ends: the same function


def test_sequence_parallel_keeps_the_residual_stream_on_token_shards_between_regions() -> None:
    gm = fx.symbolic_trace(Block())
    shards = {"embed.weight": VOCAB, "up.weight": COLUMN, "up.bias": COLUMN, "down.weight": ROW}
    regions = region_nodes(gm, shards, sequence_parallel=True)
    assert regions.inside == {"embed", "up", "relu", "down"} and regions.closing == {"embed", "down"}
    assert regions.spread == {"add", "norm"}  # the residual add and the norm after it

    def enter(x: object) -> object:
        return x

    def leave(x: object) -> object:
        return x

    def whole(x: object) -> object:
        return x

    def join(x: object) -> object:
        return x

    ends = (enter, leave, whole, join)
    out = shard_regions(gm, shards, enter=enter, leave=leave, whole=whole, join=join)
    calls = [(n.target.__name__, n.args[0].name) for n in out.graph.nodes if n.target in ends]
    # the region closes into token shards, which `up` gathers and the add reads as they are; the
    # norm reads the add's shard (joined: it might have been plain), the stage returns it whole
    assert calls == [("enter", "ids"), ("leave", "embed"), ("enter", "leave"), ("leave", "down"),
                     ("join", "add"), ("whole", "norm")]
    # every end, and nothing else, runs eagerly in a stage compiled apart
    assert {n.name for n in out.graph.nodes if n.meta.get(EAGER)} == {n.name for n in out.graph.nodes if n.target in ends}
    ids = torch.randint(0, 16, (2, 3))
    torch.testing.assert_close(out(ids), gm(ids))


def test_the_graph_splits_linear_pairs_and_the_embedding() -> None:
    model = Block()
    plan = pipecut.plan(model, (torch.randint(0, 16, (4, 3)),), devices=1, loss_fn=lambda y, t: y.sum(),
                        microbatches=1, schedule="gpipe", measure=pipecut.MeasureOptions(estimate="A100-80GB"))
    classes = {name: type(m).__name__ for name, m in model.named_modules()}
    shards = parameter_shards(plan.nodes, classes)
    assert shards == {"embed.weight": VOCAB, "up.weight": COLUMN, "up.bias": COLUMN, "down.weight": ROW}
    # without the classes the table names `embed` by its path only; it reads integers, so it is a
    # lookup all the same (it was taken for a column product before the closed-form check found it)
    assert parameter_shards(plan.nodes) == shards


def test_a_models_tp_plan_and_a_users_plan() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    styles = model_tp_plan(model)
    assert styles["model.layers.*.self_attn.o_proj"] == "rowwise" and styles["lm_head"] == "colwise_gather_output"
    params = {n: p.shape for n, p in model.named_parameters()}
    shards = _from_styles({"model.layers.*.self_attn.q_proj": TensorShard.COLUMN,
                           "model.layers.*.self_attn.o_proj": TensorShard.ROW,
                           "model.embed_tokens": TensorShard.VOCAB}, params)
    assert shards == {"model.layers.0.self_attn.q_proj.weight": COLUMN, "model.layers.0.self_attn.o_proj.weight": ROW,
                      "model.embed_tokens.weight": VOCAB}


def test_tensor_parallel_options_normalise_and_round_trip_in_a_plan() -> None:
    options = pipecut.TensorParallelOptions(plan={"b.*.down": "row", "a.up": pipecut.TensorShard.COLUMN}, size=2)
    assert options.plan == (("a.up", TensorShard.COLUMN), ("b.*.down", TensorShard.ROW))
    with pytest.raises(InputError, match="unknown tensor-parallel kind of 'x' 'diagonal'; choose one of"):
        pipecut.TensorParallelOptions(plan={"x": "diagonal"})
    with pytest.raises(InputError, match="size=0"):
        pipecut.TensorParallelOptions(size=0)
    plan = pipecut.plan(Block(), (torch.randint(0, 16, (4, 3)),), devices=1, loss_fn=lambda y, t: y.sum(),
                        microbatches=1, schedule="gpipe", measure=pipecut.MeasureOptions(estimate="A100-80GB"))
    assert plan.options is not None and plan.options.tensor_parallel == pipecut.TensorParallelOptions()
    import dataclasses

    recorded = dataclasses.replace(plan, options=dataclasses.replace(plan.options, tensor_parallel=options))
    assert Plan.from_json(recorded.to_json()).options.tensor_parallel == options  # type: ignore[union-attr]


class Attention(nn.Module):
    """Heads from a column product, attention, a row product; and attention on the plain input."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        plain = torch.nn.functional.scaled_dot_product_attention(x, x, x)  # outside every region
        return self.out(heads.transpose(1, 2).reshape(b, s, 8)) + plain


def test_attention_inside_a_region_calls_what_heads_makes_of_its_op() -> None:
    gm = fx.symbolic_trace(Attention())
    shards = {"qkv.weight": COLUMN, "qkv.bias": COLUMN, "out.weight": ROW}
    seen: list[object] = []

    def heads(op: Any) -> Any:
        def on_heads(*args: Any, **kwargs: Any) -> Any:
            seen.append(op)
            return op(*args, **kwargs)
        return on_heads

    out = shard_regions(gm, shards, enter=lambda x: x, leave=lambda x: x, heads=heads)
    handed = [n for n in out.graph.nodes if getattr(n.target, "__name__", "") == "on_heads"]
    assert len(handed) == 1 and handed[0].kwargs == {"is_causal": True} and len(handed[0].args) == 3
    # the attention on the plain input stays as it was; the input graph is untouched
    assert sum(n.target is torch.nn.functional.scaled_dot_product_attention for n in out.graph.nodes) == 1
    assert not any(getattr(n.target, "__name__", "") == "on_heads" for n in gm.graph.nodes)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(out(x), gm(x))
    assert seen == [torch.nn.functional.scaled_dot_product_attention]
    # without ``heads`` the op stays in the graph (the runtime always gives it)
    plain = shard_regions(gm, shards, enter=lambda x: x, leave=lambda x: x)
    assert sum(n.target is torch.nn.functional.scaled_dot_product_attention for n in plain.graph.nodes) == 2
