"""Wire specs from fake-tensor propagation; accepted shapes; microbatch splitting; dtype checks."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

import pytest
import torch

import pipecut
from examples import gpt, mlp
from pipecut.assemble.resolve import WireSpecs, schedules
from pipecut.capture import capture
from pipecut.core.batching import split_by_sizes
from pipecut.core.cut_values import describe
from pipecut.core.kinds import LeafKind, ScheduleKind
from pipecut.core.shapes import (
    AutocastState,
    accepted,
    check_microbatch,
    loss_weights,
    microbatch_sizes,
    planned_signature,
    signature,
)
from pipecut.errors import InputError, PipelineRuntimeError
from pipecut.ir import InputShape, Plan
from pipecut.passes.rewrite.propagate import (
    PropagationError,
    accepted_shapes,
    cut_values,
    propagate,
)
from pipecut.runtime.comm.wire import WireSpec, pack, unpack

OFF = AutocastState("", False, "")
BF16 = AutocastState("cpu", True, "bfloat16")
CPU = torch.device("cpu")


def _plan(build: Any, m: int = 2, **kw: Any) -> tuple[Plan, Any, list[Any]]:
    model, inputs, loss_fn, target = build(**kw)
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=m,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0, calibrate=False),
    )
    captured = capture(model, tuple(x[: x.shape[0] // m] for x in inputs))
    return Plan.from_json(plan.to_json()), captured, [x[: x.shape[0] // m] for x in inputs]


@pytest.fixture(scope="module")
def gpt_plan() -> tuple[Plan, Any, list[Any]]:
    return _plan(gpt.build, batch_size=4, vocab=64, dim=32, heads=2, layers=2, seq=16)


@pytest.fixture(scope="module")
def mlp_plan() -> tuple[Plan, Any, list[Any]]:
    return _plan(mlp.build, batch_size=4, width=16, depth=4)


def test_propagation_at_planned_shapes_gives_the_profiled_leaves(gpt_plan: Any) -> None:
    plan, captured, first = gpt_plan
    meta = {n.name: dict(n.meta) for n in captured.gm.graph.nodes}
    values = propagate(captured.gm, first, device=CPU, autocast=OFF)
    checked = 0
    for node in plan.nodes:
        if node.op.value in ("output", "placeholder"):
            continue
        leaves, treespec = describe(values[node.name])
        assert (leaves, treespec) == (node.leaves, node.treespec), node.name
        checked += 1
    assert checked > 50
    assert {n.name: dict(n.meta) for n in captured.gm.graph.nodes} == meta  # the graph is untouched


def test_autocast_and_shorter_sequence_change_cut_dtypes_and_sizes(gpt_plan: Any) -> None:
    plan, captured, first = gpt_plan
    short = [first[0][:, :9]]
    cuts = cut_values(captured.gm, plan, short, device=CPU, autocast=BF16)
    assert set(cuts) == {n for s in plan.stages for n in (*s.inputs, *s.outputs)}
    tensors = [leaf for c in cuts.values() for leaf in c.leaves if leaf.kind is LeafKind.TENSOR]
    assert tensors and all(leaf.shape[:2] == (2, 9) for leaf in tensors if len(leaf.shape) == 3)
    values = propagate(captured.gm, short, device=CPU, autocast=BF16)
    assert values["blocks_0_qkv"].dtype == torch.bfloat16  # a Linear under autocast
    assert values["blocks_0_ln1"].dtype == torch.float32  # LayerNorm autocasts to fp32
    assert values["size"] == 9  # idx.size(1): a size constant that follows the sequence length
    plain = propagate(captured.gm, short, device=CPU, autocast=OFF)
    assert plain["blocks_0_qkv"].dtype == torch.float32


def test_propagation_failure_names_the_node(mlp_plan: Any) -> None:
    _, captured, first = mlp_plan
    with pytest.raises(PropagationError, match=r"node layers_0_0 \(call_module layers.0.0\).*15"):
        propagate(captured.gm, [first[0][:, :15]], device=CPU, autocast=OFF)


def test_accepted_shapes_of_symbolic_trace(gpt_plan: Any, mlp_plan: Any) -> None:
    # symbolic_trace: the GPT takes any shorter sequence; the MLP's width is fixed by its Linear.
    assert gpt_plan[0].accepts == (InputShape(name="idx", dtype="int64", min_shape=(1, 1), max_shape=(2, 16)),)
    assert mlp_plan[0].accepts == (InputShape(name="x", dtype="float32", min_shape=(1, 16), max_shape=(2, 16)),)
    # torch.export keeps its own symbolic dimensions: checked on GPT-2 in tests/multiprocess/test_amp_shapes.py.


def test_inputs_sharing_a_sequence_length_must_agree() -> None:
    from examples import zoo

    model, inputs, loss_fn, target = zoo.tagger(batch_size=4)
    first = {k: v[:2] for k, v in inputs.items()}
    captured = capture(model, first)
    shapes = accepted_shapes(captured.gm, captured.method, captured.input_names, captured.flatten_inputs(first))
    assert [(s.name, s.min_shape, s.max_shape, s.symbols) for s in shapes] == [
        ("tokens", (1, 1), (2, 16), ("", "size16")), ("mask", (1, 1), (2, 16), ("", "size16")),
    ]
    plan = dataclasses.replace(
        pipecut.plan(
            model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2,
            measure=pipecut.MeasureOptions(repeats=1, warmup=0, calibrate=False),
        ),
        accepts=shapes,
    )
    check_microbatch(plan, ["tokens", "mask"], [torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 12)])
    with pytest.raises(InputError, match="input 'mask' has size 10 where 'tokens' has 12"):
        check_microbatch(plan, ["tokens", "mask"], [torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 10)])


def test_plans_without_accepted_shapes_accept_exactly_the_planned_ones(mlp_plan: Any) -> None:
    old = dataclasses.replace(mlp_plan[0], accepts=())
    assert accepted(old) == (InputShape(name="x", dtype="float32", min_shape=(2, 16), max_shape=(2, 16)),)
    assert microbatch_sizes(4, old) == (2, 2)
    with pytest.raises(InputError, match=r"a batch of 3 does not split into at most 2 microbatches of 2\.\.2"):
        microbatch_sizes(3, old)


@pytest.mark.parametrize(
    ("batch", "lo", "expected"),
    [
        (16, 1, (4, 4, 4, 4)),
        (12, 1, (3, 3, 3, 3)),
        (10, 1, (3, 3, 2, 2)),  # uneven
        (3, 1, (1, 1, 1)),  # fewer microbatches than planned
        (6, 2, (2, 2, 2)),  # export's lower bound of 2 per microbatch
        (16, 4, (4, 4, 4, 4)),
    ],
)
def test_microbatch_sizes(mlp_plan: Any, batch: int, lo: int, expected: tuple[int, ...]) -> None:
    plan = dataclasses.replace(
        mlp_plan[0], batch_size=16, microbatches=4,
        accepts=(InputShape(name="x", dtype="float32", min_shape=(lo, 16), max_shape=(4, 16)),),
    )
    assert microbatch_sizes(batch, plan) == expected


def test_interleaved_schedules_get_a_multiple_of_the_ranks() -> None:
    model, inputs, loss_fn, target = mlp.build(batch_size=16, width=16, depth=4)
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=4,
        schedule=ScheduleKind.INTERLEAVED_1F1B,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0, calibrate=False),
        scheduling=pipecut.ScheduleOptions(stages_per_rank=2),
    )
    assert plan.num_ranks == 2 and plan.num_stages == 4
    assert microbatch_sizes(10, plan) == (3, 3, 2, 2)
    assert microbatch_sizes(3, plan) == (2, 1)
    with pytest.raises(InputError, match="a batch of 1 does not split"):
        microbatch_sizes(1, plan)


def test_interleaved_with_one_stage_per_rank_runs_any_count(mlp_plan: Any) -> None:
    """It is plain 1F1B (tests/multiprocess/test_fuzz_regressions.py: M = 3 on 2 ranks was refused at
    every step, even with the planned batch)."""
    plan = dataclasses.replace(mlp_plan[0], batch_size=6, microbatches=3, schedule=ScheduleKind.INTERLEAVED_1F1B,
                               stages_per_rank=1,
                               accepts=(InputShape(name="x", dtype="float32", min_shape=(1, 16), max_shape=(2, 16)),))
    assert plan.num_ranks == 2
    assert microbatch_sizes(6, plan) == (2, 2, 2)
    assert microbatch_sizes(3, plan) == (1, 1, 1)
    assert microbatch_sizes(1, plan) == (1,)


def test_microbatch_sizes_refuse_what_cannot_split(mlp_plan: Any) -> None:
    plan = dataclasses.replace(
        mlp_plan[0], batch_size=8, microbatches=4,
        accepts=(InputShape(name="x", dtype="float32", min_shape=(2, 16), max_shape=(2, 16)),),
    )
    with pytest.raises(InputError, match=r"more than the planned 8.*x: float32 \[2, 16\].*re-plan"):
        microbatch_sizes(9, plan)
    with pytest.raises(InputError, match=r"a batch of 7 does not split into at most 4 microbatches of 2\.\.2"):
        microbatch_sizes(7, plan)
    with pytest.raises(InputError, match="a batch of 1 does not split"):
        microbatch_sizes(1, plan)


def test_loss_weights_give_the_batch_mean() -> None:
    assert loss_weights((4, 4, 4, 4)) == (Fraction(1, 4),) * 4  # exactly loss / M
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sizes = (3, 3, 2, 2)
    per_sample = torch.cat([torch.full((s,), float(v)) for s, v in zip(sizes, losses)])
    weighted = sum(float(v) * w for v, w in zip(losses, loss_weights(sizes)))
    assert weighted == pytest.approx(per_sample.mean().item())


def test_split_by_sizes_cuts_every_batched_tensor() -> None:
    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    parts = split_by_sizes({"x": x, "y": y, "flag": True}, (3, 2))
    assert [p["x"].shape[0] for p in parts] == [3, 2] and parts[1]["y"].tolist() == [3, 4]
    assert parts[0]["flag"] is True
    with pytest.raises(InputError, match=r"shape \(5, 2\) does not have the batch size 4"):
        split_by_sizes(x, (2, 2))


def test_check_microbatch(mlp_plan: Any) -> None:
    plan = mlp_plan[0]
    check_microbatch(plan, ["x"], [torch.zeros(1, 16)])
    with pytest.raises(InputError, match=r"input 'x' has microbatch shape \(2, 12\).*x: float32 \[1..2, 16\]"):
        check_microbatch(plan, ["x"], [torch.zeros(2, 12)])
    with pytest.raises(InputError, match="input 'x' has dtype float64, the plan has float32"):
        check_microbatch(plan, ["x"], [torch.zeros(2, 16, dtype=torch.float64)])
    tied = dataclasses.replace(plan, accepts=(
        InputShape(name="x", dtype="float32", min_shape=(1, 1), max_shape=(2, 16), symbols=("s0", "s0")),
    ))
    with pytest.raises(InputError, match="input 'x' has size 3 where 'x' has 2"):
        check_microbatch(tied, ["x"], [torch.zeros(2, 3)])


def test_wire_specs_resolver(gpt_plan: Any, mlp_plan: Any) -> None:
    plan, captured, first = gpt_plan
    resolve = WireSpecs(captured.gm, plan, CPU)
    assert resolve(planned_signature(plan), first) is None  # the plan's own rows
    assert signature(first, AutocastState.current("cpu")) == planned_signature(plan)  # no propagation
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert AutocastState.current("cpu") == BF16
    amp = resolve(signature(first, BF16), first)
    assert amp is resolve(signature(first, BF16), first)  # cached per signature
    assert amp is not None and set(amp) == {n for s in plan.stages for n in (*s.inputs, *s.outputs)}
    plan, captured, first = mlp_plan
    amp = WireSpecs(captured.gm, plan, CPU)(signature(first, BF16), first)
    assert amp is not None
    assert [leaf.dtype for c in amp.values() for leaf in c.leaves] == ["bfloat16"]  # a GELU of a Linear
    bad = [first[0][:, :15]]
    with pytest.raises(InputError, match=r"\[\(\(2, 15\), 'float32'\)\].*do not run through.*layers_0_0.*re-plan"):
        WireSpecs(captured.gm, plan, CPU)(signature(bad, OFF), bad)


def test_fewer_microbatches_get_their_own_schedule(gpt_plan: Any) -> None:
    plan = dataclasses.replace(gpt_plan[0], microbatches=4, batch_size=8)
    schedule_for = schedules(plan)
    assert {a.microbatch for rank in schedule_for(3) for a in rank} == {0, 1, 2}
    assert schedule_for(3) is schedule_for(3)


def _spec(dtype: str, shape: tuple[int, ...] = (2, 4)) -> WireSpec:
    from pipecut.core.kinds import NodeOp
    from pipecut.ir import NodeCost

    value = torch.zeros(shape, dtype=getattr(torch, dtype), requires_grad=True)
    leaves, treespec = describe(value)
    return WireSpec((NodeCost(name="relu_3", op=NodeOp.CALL_FUNCTION, target="relu", leaves=leaves,
                              treespec=treespec),))


def test_pack_and_unpack_refuse_a_dtype_or_shape_the_spec_does_not_have() -> None:
    spec = _spec("float32")
    with pytest.raises(PipelineRuntimeError, match=(
        r"stage 1 sends value relu_3 \(tensor leaf 0\) as bfloat16 \[2, 4\], but the wire spec .* "
        r"has float32 \[2, 4\].*same torch.autocast state"
    )):
        pack([torch.zeros(2, 4, dtype=torch.bfloat16)], spec, 1)
    with pytest.raises(PipelineRuntimeError, match=r"sends value relu_3 \(tensor leaf 0\) as float32 \[2, 3\]"):
        pack([torch.zeros(2, 3)], spec, 1)
    assert pack([torch.ones(2, 4)], spec, 1)[0].dtype == torch.float32
    bf16 = _spec("bfloat16")
    with pytest.raises(PipelineRuntimeError, match=(
        r"stage 2 received value relu_3 \(tensor leaf 0\) as float16 \[2, 4\], but the wire spec .* "
        r"has bfloat16 \[2, 4\]"
    )):
        unpack([torch.zeros(2, 4, dtype=torch.float16)], bf16, 2)
    with pytest.raises(PipelineRuntimeError, match="stage 2 received 0 tensors, the wire spec has 1"):
        unpack([], bf16, 2)
    (value,) = unpack([torch.ones(2, 4, dtype=torch.bfloat16)], bf16, 2)
    assert value.dtype == torch.bfloat16
