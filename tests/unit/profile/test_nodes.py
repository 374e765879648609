"""Profiling measures every node and leaves the model exactly as it was."""

from __future__ import annotations

import pytest
import torch

import pipecut
from examples import gpt, resnet
from pipecut.capture import capture
from pipecut.core.kinds import LeafKind, NodeOp
from pipecut.errors import InputError
from pipecut.profile.nodes import profile


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.update({f"{n}.grad": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return state


def test_profile_leaves_weights_buffers_grads_and_rng_untouched() -> None:
    model, inputs, loss_fn, target = resnet.build(batch_size=4)
    model.fc.weight.grad = torch.full_like(model.fc.weight, 0.5)  # an existing gradient stays
    before = _snapshot(model)
    rng = torch.get_rng_state()
    cap = capture(model, inputs)
    rows = profile(cap, cap.flatten_inputs(inputs), loss_fn=loss_fn, target=target, repeats=2, warmup=1)
    after = _snapshot(model)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k  # BatchNorm running stats included
    assert model.conv1.weight.grad is None if hasattr(model, "conv1") else model.stem[0].weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(rows) == len(cap.gm.graph.nodes)


def test_rows_describe_every_node() -> None:
    model, inputs, loss_fn, target = gpt.build(batch_size=2)
    cap = capture(model, inputs)
    rows = profile(cap, cap.flatten_inputs(inputs), loss_fn=loss_fn, target=target, repeats=2, warmup=1)
    by_name = {r.name: r for r in rows}
    compute = [r for r in rows if r.op in (NodeOp.CALL_MODULE, NodeOp.CALL_FUNCTION, NodeOp.CALL_METHOD)]
    assert all(r.forward_ms > 0 for r in compute)
    assert sum(r.backward_ms for r in compute) > 0
    head = next(r for r in rows if r.target == "lm_head")
    assert head.shape == (2, 64, 512) and head.dtype == "float32"
    assert head.output_bytes == 2 * 64 * 512 * 4
    assert head.parameters == ("tok_emb.weight",)  # the tied weight under its canonical name
    assert head.leaves[0].requires_grad
    size = next(r for r in rows if r.op is NodeOp.CALL_METHOD and r.target == "size")
    assert size.leaves[0].kind is LeafKind.CONSTANT and size.leaves[0].value == {"t": "int", "v": 64}  # idx.size(1)
    out = by_name["output"]
    assert out.forward_ms > 0  # the loss is timed on the output node


def test_only_the_named_nodes_are_timed_the_rest_still_described() -> None:
    model, inputs, loss_fn, target = gpt.build(batch_size=2)
    cap = capture(model, inputs)
    flat = cap.flatten_inputs(inputs)
    full = profile(cap, flat, loss_fn=loss_fn, target=target, repeats=1, warmup=0)
    some = profile(cap, flat, loss_fn=loss_fn, target=target, repeats=1, warmup=0, only={"lm_head", "ln_f"})
    timed = {r.name for r in some if r.forward_ms > 0 or r.backward_ms > 0}
    assert timed == {"lm_head", "ln_f"}  # not even the loss on the output row
    for a, b in zip(full, some):  # everything but the times is as a full profile gives it
        assert (a.name, a.shape, a.output_bytes, a.saved_bytes, a.parameters, a.leaves) == (
            b.name, b.shape, b.output_bytes, b.saved_bytes, b.parameters, b.leaves)


def test_a_loss_that_is_not_a_scalar_is_refused() -> None:
    model, inputs, _, target = resnet.build(batch_size=4)

    def per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, y, reduction="none")

    with pytest.raises(InputError, match=r"scalar tensor, got a tensor of shape \(2,\); reduce it"):
        pipecut.plan(
            model, inputs, 2, loss_fn=per_sample, target=target, microbatches=2,
            measure=pipecut.MeasureOptions(repeats=1, warmup=0),
        )


def test_identical_blocks_are_measured_once_and_share_their_times() -> None:
    model, inputs, loss_fn, target = gpt.build(batch_size=2)
    cap = capture(model, inputs)
    rows = {r.name: r for r in profile(cap, cap.flatten_inputs(inputs), loss_fn=loss_fn, target=target,
                                       repeats=2, warmup=1)}
    by_module: dict[str, list[str]] = {}
    for r in rows.values():
        if r.op is not NodeOp.PLACEHOLDER and r.module.startswith("blocks."):
            by_module.setdefault(r.module.split(".", 2)[1], []).append(r.name)
    first, *others = sorted(by_module)
    assert others, "the example GPT has several blocks"
    for other in others:  # node i of every block costs what node i of the first block costs
        for a, b in zip(by_module[first], by_module[other]):
            assert (rows[a].forward_ms, rows[a].backward_ms) == (rows[b].forward_ms, rows[b].backward_ms)
    measured_alone = profile(cap, cap.flatten_inputs(inputs), loss_fn=loss_fn, target=target,
                             repeats=2, warmup=1, reuse=False)
    assert [r.name for r in measured_alone] == list(rows)
    assert [r.output_bytes for r in measured_alone] == [r.output_bytes for r in rows.values()]


def test_cost_key_tells_shapes_modes_and_configurations_apart() -> None:
    from pipecut.profile.signature import cost_key

    root = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4),
                                "c": torch.nn.Linear(4, 8), "d": torch.nn.Dropout(0.1),
                                "e": torch.nn.Dropout(0.2)})
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = {k: graph.call_module(k, (x,)) for k in ("a", "b", "c", "d", "e")}
    fn = graph.call_function(torch.add, (x, 1.0))
    t, t2 = torch.randn(2, 4), torch.randn(3, 4)

    def key(name: str, *args: object) -> object:
        return cost_key(nodes[name], root, args, {}, False)

    assert key("a", t) == key("b", t) is not None  # same type, configuration and shapes
    assert key("a", t) != key("a", t2)  # shape
    assert key("a", t) != key("a", t.requires_grad_())  # gradient flows back
    assert key("a", t2) != key("c", t2)  # configuration (out_features)
    assert key("d", t2) != key("e", t2)  # repr differs (p)
    before = key("d", t2)
    root.d.eval()
    assert key("d", t2) != before  # training mode
    assert cost_key(fn, root, (t2, 1.0), {}, False) != cost_key(fn, root, (t2, 2.0), {}, False)
    assert cost_key(fn, root, (t2, object()), {}, False) is None  # opaque argument: measured alone


def test_profiling_on_another_device_copies_one_nodes_weights_at_a_time() -> None:
    """A model left on the CPU is measured on the device its stages will run on (``device=``):
    every module runs with its weights there, the user's tensors never move, and only the node
    being measured has a copy. On a CPU-only machine the meta device stands in for the GPU (the
    copy path is the same; the times are not meaningful there)."""
    model, inputs, loss_fn, target = gpt.build(batch_size=2)
    before = _snapshot(model)
    originals = {n: p for n, p in model.named_parameters()}
    cap = capture(model, inputs)
    seen: dict[str, set[str]] = {}
    live_copies: list[int] = []

    def hook(module: torch.nn.Module, args: object) -> None:
        own = list(module.parameters(recurse=False))
        if own:
            seen.setdefault(type(module).__name__, set()).update(p.device.type for p in own)
            live_copies.append(sum(p.device.type == "meta" for p in cap.gm.parameters()))

    handles = [m.register_forward_pre_hook(hook) for m in cap.gm.modules()]
    try:
        rows = profile(cap, cap.flatten_inputs(inputs), loss_fn=loss_fn, target=target, repeats=1,
                       warmup=0, device="meta")
    finally:
        for h in handles:
            h.remove()
    assert len(rows) == len(cap.gm.graph.nodes)
    assert seen and all(kinds == {"meta"} for kinds in seen.values()), seen
    assert max(live_copies) <= 2  # a Linear's weight and bias, never the whole model
    assert all(p.device.type == "cpu" for p in cap.gm.parameters())
    assert {n: p for n, p in model.named_parameters()} == originals
    after = _snapshot(model)
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_plan_records_where_it_measured_and_skips_whole_stage_calibration_elsewhere() -> None:
    model, inputs, loss_fn, target = gpt.build(batch_size=4)
    here = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
    )
    assert here.profiled_on == "cpu"
    assert "calibrated on whole stages" in here.solver.detail
    there = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0, device="meta"),
    )
    assert there.profiled_on == "meta"
    assert "measured one at a time on meta" in there.solver.detail
    assert pipecut.Plan.from_json(there.to_json()).profiled_on == "meta"
