"""Tensor parallelism on a cost table: Megatron's regions found from the graph, the collectives a
block pays on NVLink, and one GPU's share of parameters, activations and time."""

from __future__ import annotations

import pytest

from pipecut.cluster import Link
from pipecut.core.kinds import NodeOp, TensorShard
from pipecut.errors import InputError
from pipecut.ir import NodeCost
from pipecut.passes.costs.stages import ring_ms
from pipecut.passes.parallel.tensor import (
    check_tensor_parallel,
    collectives,
    parameter_shards,
    shard_kinds,
    shard_table,
    sharded_widths,
    tensor_sizes,
)

H, F, TOKENS = 64, 128, 32  # hidden, MLP width, tokens of the microbatch
ACT = 2 * TOKENS * H  # bf16 bytes of one [tokens, hidden] value
NVLINK = Link(bandwidth_bytes_per_ms=360e6, latency_ms=0.01, name="NVLink 4")


def _block() -> tuple[NodeCost, ...]:
    """Embedding, one Llama block (GQA: k and v at half width), final norm, head, loss."""
    rows: list[NodeCost] = [NodeCost(name="ids", op=NodeOp.PLACEHOLDER, target="ids", output_bytes=8 * TOKENS)]

    def weight(name: str, *shape: int) -> str:
        size = 2
        for s in shape:
            size *= s
        rows.append(NodeCost(name=f"{name}_w", op=NodeOp.GET_ATTR, target=f"{name}.weight", param_bytes=size,
                             shape=shape, parameters=(f"{name}.weight",)))
        return f"{name}_w"

    def node(name: str, target: str, *inputs: str, width: int = H, ms: float = 1.0) -> str:
        rows.append(NodeCost(name=name, op=NodeOp.CALL_FUNCTION, target=target, inputs=inputs,
                             module=f"layers.0.{name}", forward_ms=ms, backward_ms=2 * ms,
                             output_bytes=2 * TOKENS * width, saved_bytes=2 * TOKENS * width,
                             shape=(TOKENS, width)))
        return name

    emb = node("emb", "aten.embedding", weight("emb", 100, H), "ids")
    n1 = node("norm1", "aten.rms_norm", emb, weight("norm1", H))
    q = node("q", "aten.linear", n1, weight("q", H, H))
    k = node("k", "aten.linear", n1, weight("k", H // 2, H), width=H // 2)
    v = node("v", "aten.linear", n1, weight("v", H // 2, H), width=H // 2)
    att = node("sdpa", "aten.scaled_dot_product_attention", q, k, v)
    o = node("o", "aten.linear", att, weight("o", H, H))
    a1 = node("add1", "aten.add", emb, o)
    n2 = node("norm2", "aten.rms_norm", a1, weight("norm2", H))
    g = node("gate", "aten.linear", n2, weight("gate", F, H), width=F)
    u = node("up", "aten.linear", n2, weight("up", F, H), width=F)
    act = node("silu_mul", "aten.mul", g, u, width=F)
    d = node("down", "aten.linear", act, weight("down", H, F))
    a2 = node("add2", "aten.add", a1, d)
    n3 = node("norm", "aten.rms_norm", a2, weight("norm", H))
    head = node("head", "aten.linear", n3, weight("head", 100, H), width=100)
    rows.append(NodeCost(name="output", op=NodeOp.OUTPUT, target="output+loss", inputs=(head,),
                         forward_ms=1.0, backward_ms=1.0))
    return tuple(rows)


def test_megatron_regions_are_found_from_the_graph() -> None:
    kinds = shard_kinds(_block())
    shown = {n: k for n, k in kinds.items() if not n.endswith("_w") and n != "ids"}
    assert shown == {
        "emb": TensorShard.VOCAB, "norm1": TensorShard.REPLICATED,
        "q": TensorShard.COLUMN, "k": TensorShard.COLUMN, "v": TensorShard.COLUMN,
        "sdpa": TensorShard.SPLIT, "o": TensorShard.ROW, "add1": TensorShard.REPLICATED,
        "norm2": TensorShard.REPLICATED, "gate": TensorShard.COLUMN, "up": TensorShard.COLUMN,
        "silu_mul": TensorShard.SPLIT, "down": TensorShard.ROW, "add2": TensorShard.REPLICATED,
        "norm": TensorShard.REPLICATED, "head": TensorShard.COLUMN, "output": TensorShard.SPLIT,
    }
    assert sharded_widths(_block(), kinds) == (H // 2, H, 100, F)


def test_a_t2_block_costs_its_four_all_reduces_on_nvlink() -> None:
    """Two forward (after o and down), two backward (q/k/v's shared input once, gate/up's once),
    plus the embedding's forward reduce and the head's backward one."""
    rows = _block()
    comm = collectives(rows, shard_kinds(rows), 2, NVLINK, sequence_parallel=False)
    all_reduce = 2 * ring_ms(ACT, 2, NVLINK)
    assert all_reduce == pytest.approx(2 * (0.01 + ACT / 2 / 360e6))
    assert comm == {"emb": (all_reduce, 0.0), "q": (0.0, all_reduce), "o": (all_reduce, 0.0),
                    "gate": (0.0, all_reduce), "down": (all_reduce, 0.0), "head": (0.0, all_reduce)}
    block = sum(f + b for n, (f, b) in comm.items() if n in ("q", "o", "gate", "down"))
    assert block == pytest.approx(4 * all_reduce)


def test_sequence_parallel_moves_the_same_bytes_as_reduce_scatter_and_all_gather() -> None:
    rows = _block()
    plain = collectives(rows, shard_kinds(rows), 8, NVLINK, sequence_parallel=False)
    seq = collectives(rows, shard_kinds(rows), 8, NVLINK, sequence_parallel=True)
    one = ring_ms(ACT, 8, NVLINK)  # a reduce-scatter or an all-gather
    assert seq["o"] == pytest.approx((one, one)) and seq["q"] == pytest.approx((one, one))
    assert sum(map(sum, seq.values())) == pytest.approx(sum(map(sum, plain.values())))


def test_one_gpus_share_divides_weights_activations_and_time() -> None:
    rows = _block()
    by = {n.name: n for n in rows}
    table = shard_table(rows, 2, NVLINK, sequence_parallel=False)
    got = {n.name: n for n in table.nodes}
    for w in ("q_w", "k_w", "o_w", "gate_w", "down_w", "emb_w", "head_w"):
        assert got[w].param_bytes == by[w].param_bytes // 2, w
    assert got["norm1_w"].param_bytes == by["norm1_w"].param_bytes  # norms stay whole
    assert got["sdpa"].saved_bytes == by["sdpa"].saved_bytes // 2  # heads split
    assert got["add1"].saved_bytes == by["add1"].saved_bytes  # the residual stream is whole
    assert got["sdpa"].forward_ms == pytest.approx(0.5)
    assert got["norm1"].forward_ms == 1.0
    f, b = table.collectives["o"]
    assert got["o"].forward_ms == pytest.approx(0.5 + f) and got["o"].backward_ms == pytest.approx(1.0 + b)
    seq = {n.name: n for n in shard_table(rows, 2, NVLINK, sequence_parallel=True).nodes}
    assert seq["add1"].saved_bytes == by["add1"].saved_bytes // 2 and seq["norm1"].forward_ms == 0.5
    # what q, k and v read is gathered: it crosses a cut split, but autograd keeps the gathered copy
    assert seq["norm1"].output_bytes == by["norm1"].output_bytes // 2
    assert seq["norm1"].saved_bytes == by["norm1"].saved_bytes and seq["norm2"].saved_bytes == by["norm2"].saved_bytes
    assert seq["emb"].forward_ms == pytest.approx(1.0 + table.collectives["emb"][0] / 2)  # the lookup stays whole


def test_regathered_inputs_are_kept_as_shards_and_gathered_again_in_the_backward() -> None:
    """Megatron's and Transformer Engine's column products keep their input's shard under
    sequence parallelism and all-gather it again in the backward: its saved bytes are divided
    by T, and its first reader's backward waits for one more all-gather."""
    rows = _block()
    by = {n.name: n for n in rows}
    kept = shard_table(rows, 2, NVLINK, sequence_parallel=True)
    again = shard_table(rows, 2, NVLINK, sequence_parallel=True, regather=True)
    got = {n.name: n for n in again.nodes}
    assert got["norm1"].saved_bytes == by["norm1"].saved_bytes // 2
    assert got["norm2"].saved_bytes == by["norm2"].saved_bytes // 2
    one = ring_ms(ACT, 2, NVLINK)
    assert again.collectives["q"] == pytest.approx((one, 2 * one))
    assert kept.collectives["q"] == pytest.approx((one, one))
    assert again.collectives["o"] == kept.collectives["o"]  # a row product's collective is as before
    # without sequence parallelism nothing is gathered: the flag changes nothing
    assert shard_table(rows, 2, NVLINK, sequence_parallel=False, regather=True) == shard_table(
        rows, 2, NVLINK, sequence_parallel=False)


def test_caller_priced_times_replace_the_division() -> None:
    rows = _block()
    table = shard_table(rows, 2, NVLINK, sequence_parallel=False, times={"q": (0.7, 1.6)})
    q = next(n for n in table.nodes if n.name == "q")
    assert q.forward_ms == 0.7 and q.backward_ms == pytest.approx(1.6 + table.collectives["q"][1])
    assert shard_table(rows, 1, NVLINK, sequence_parallel=True).nodes == rows


def test_tensor_sizes_divide_the_node_and_the_heads() -> None:
    assert tensor_sizes(8, (64, 8)) == (1, 2, 4, 8)
    assert tensor_sizes(8, (12,)) == (1, 2, 4)
    assert tensor_sizes(4, (1,)) == (1,)
    check_tensor_parallel(8, 8, {"attention heads": 64, "KV heads": 8})
    with pytest.raises(InputError, match=r"tensor_parallel=3 must divide the GPUs per node \(8\) and the "
                                         r"attention heads \(64\).*sizes that run: 1, 2, 4, 8"):
        check_tensor_parallel(3, 8, {"attention heads": 64})
    with pytest.raises(InputError, match=r"KV heads \(2\)"):
        check_tensor_parallel(4, 8, {"attention heads": 32, "KV heads": 2})


def test_async_tensor_parallelism_hides_each_collective_under_its_product() -> None:
    rows = _block()
    plain = shard_table(rows, 2, NVLINK, sequence_parallel=True)
    hidden = {n.name: n for n in shard_table(rows, 2, NVLINK, sequence_parallel=True, overlapped=True).nodes}
    for name, (f, b) in plain.collectives.items():  # a few µs each on NVLink, under 0.5 ms products
        assert f + b > 0
        node = next(n for n in plain.nodes if n.name == name)
        assert hidden[name].forward_ms == pytest.approx(node.forward_ms - f), name
        assert hidden[name].backward_ms == pytest.approx(node.backward_ms - b), name
    slow = Link(bandwidth_bytes_per_ms=2560.0, latency_ms=0.0, name="slow")
    one = ring_ms(ACT, 2, slow)  # 0.8 ms: longer than o's 0.5 ms forward, shorter than its 1 ms backward
    assert one == pytest.approx(0.8)
    table = shard_table(rows, 2, slow, sequence_parallel=True, overlapped=True)
    o = next(n for n in table.nodes if n.name == "o")
    assert table.collectives["o"] == pytest.approx((one - 0.5, 0.0))
    assert (o.forward_ms, o.backward_ms) == pytest.approx((one, 1.0))


def test_module_calls_are_told_apart_without_their_classes() -> None:
    """A symbolic_trace table names a module call by its path only: ``ln1`` and ``tok_emb`` say
    nothing of a norm or an embedding. Found by checking the cluster planner's activation
    memory against Korthikanti et al.'s closed form: without the classes (the cluster planner
    and compile's planner pass none), ``ln1`` was a column product and the pairing of the whole
    block shifted. A norm holds at most two vectors of its output width; a lookup reads integers."""
    def call(name: str, *inputs: str, param_bytes: int = 0, shape: tuple[int, ...] = (2, 8)) -> NodeCost:
        return NodeCost(name=name, op=NodeOp.CALL_MODULE, target=name, module=name, inputs=inputs,
                        param_bytes=param_bytes, shape=shape, dtype="float32")

    rows = [NodeCost(name="idx", op=NodeOp.PLACEHOLDER, target="idx", shape=(2,), dtype="int64"),
            call("tok_emb", "idx", param_bytes=100 * 8 * 4), call("ln1", "tok_emb", param_bytes=2 * 8 * 4),
            call("up", "ln1", param_bytes=(8 * 32 + 32) * 4, shape=(2, 32)),
            call("down", "up", param_bytes=(32 * 8 + 8) * 4), call("ln_f", "down", param_bytes=2 * 8 * 4)]
    kinds = {n: k.value for n, k in shard_kinds(rows).items()}
    assert kinds == {"idx": "replicated", "tok_emb": "vocab", "ln1": "replicated", "up": "column",
                     "down": "row", "ln_f": "replicated"}
    classes = {"tok_emb": "Embedding", "ln1": "LayerNorm", "up": "Linear", "down": "Linear", "ln_f": "LayerNorm"}
    assert shard_kinds(rows, classes) == shard_kinds(rows)


def test_the_example_gpt_is_split_alike_with_and_without_module_classes() -> None:
    import pipecut
    from examples import gpt
    from tests.reference import COUNTED

    model, inputs, loss_fn, target = gpt.build()
    plan = pipecut.plan(model, inputs, 1, loss_fn=loss_fn, target=target, microbatches=1, measure=COUNTED)
    classes = {n: type(m).__name__ for n, m in model.named_modules()}
    assert shard_kinds(plan.nodes) == shard_kinds(plan.nodes, classes)
    assert parameter_shards(plan.nodes) == parameter_shards(plan.nodes, classes)
    assert any(k is TensorShard.VOCAB for k in shard_kinds(plan.nodes).values())
