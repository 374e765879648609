"""compile's arguments against a replayed plan: None takes the plan's value, a contradiction is a
PlanError naming every conflicting argument; and the model's own names for a captured graph."""

from __future__ import annotations

import pytest
import torch

import pipecut
from examples import gpt, mlp
from pipecut.assemble.replay import settings_of
from pipecut.capture import capture
from pipecut.cluster import Link
from pipecut.core.kinds import CaptureMethod, ScheduleKind
from pipecut.core.names import model_names
from pipecut.errors import PlanError
from pipecut.ir import DeviceSpec
from pipecut.options import CaptureOptions, MeasureOptions, Options, ScheduleOptions
from pipecut.passes.partition.solve import DEFAULT_LINK


@pytest.fixture(scope="module")
def plan() -> pipecut.Plan:
    model, inputs, loss_fn, target = mlp.build(batch_size=8)
    return pipecut.plan(
        model, inputs, devices=2, loss_fn=loss_fn, target=target, microbatches=4, schedule="1f1b",
        measure=pipecut.MeasureOptions(repeats=1, warmup=0, calibrate=False),
    )


def test_none_means_the_plans_value_or_the_default(plan: pipecut.Plan) -> None:
    run = settings_of(plan, Options(), None)
    assert (run.microbatches, run.schedule, run.stages_per_rank) == (4, ScheduleKind.ONE_F_ONE_B, 1)
    assert run.link == plan.link and run.capture_method is plan.capture and not run.auto
    agreeing = Options(microbatches=4, schedule="1f1b", scheduling=ScheduleOptions(stages_per_rank=1))
    assert settings_of(plan, agreeing, 2) == run


def test_without_a_plan_what_is_left_out_is_auto_or_the_default() -> None:
    run = settings_of(None, Options(), None)
    assert (run.microbatches, run.schedule, run.stages_per_rank, run.link, run.capture_method) == (
        "auto", "auto", 1, DEFAULT_LINK, "auto")
    run = settings_of(None, Options(microbatches=4), 3)
    assert (run.microbatches, run.schedule, run.auto) == (4, ScheduleKind.GPIPE, False)
    assert settings_of(None, Options(microbatches=4, schedule="auto"), None).auto


def test_auto_is_refused_beside_a_plan(plan: pipecut.Plan) -> None:
    with pytest.raises(PlanError, match=r"'auto' ask the planner to choose, but plan= fixes them"):
        settings_of(plan, Options(microbatches="auto"), None)


def test_every_contradiction_is_named(plan: pipecut.Plan) -> None:
    conflicting = Options(
        microbatches=8, schedule="gpipe", scheduling=ScheduleOptions(stages_per_rank=2),
        capture=CaptureOptions(method=CaptureMethod.EXPORT),
        measure=MeasureOptions(link=Link(bandwidth_bytes_per_ms=1.0, latency_ms=0.0, measured=False)))
    with pytest.raises(PlanError, match=(
        r"microbatches=8 \(the plan has 4\); schedule='gpipe' \(the plan has '1f1b'\); "
        r"stages_per_rank=2 \(the plan has 1\); link=.*; capture_method='export' \(the plan has "
        r"'symbolic_trace'\); devices=3 \(the plan is for 2 ranks\)\. Leave these arguments out")):
        settings_of(plan, conflicting, 3)
    specs = [DeviceSpec(name="cpu", memory_bytes=1 << 30), DeviceSpec(name="cpu")]
    with pytest.raises(PlanError, match=r"devices=\[.*memory_bytes=1073741824.*\] \(the plan has"):
        settings_of(plan, Options(), specs)


def test_state_names_are_the_models_own() -> None:
    model, inputs, _, _ = gpt.build(vocab=32, dim=16, heads=2, layers=1, seq=8, batch_size=2)
    cap = capture(model, inputs)
    names = model_names(cap.gm, model)
    assert names.public("lm_head.weight") == "tok_emb.weight"  # the tie's first name
    assert names.state["lm_head.weight"] == ("tok_emb.weight", "lm_head.weight")
    assert names.state["blocks.0.mask"] == ()  # a non-persistent buffer: not in state_dict
    assert names.public("blocks.0.mask") == "blocks.0.mask"


def test_lifted_constants_have_no_model_name() -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in x.shape:  # symbolic_trace cannot; torch.export lifts the constant below
                x = self.fc(x)
            return x * torch.tensor([1.0, 2.0, 3.0, 4.0])

    model = Scaled()
    cap = capture(model, (torch.randn(2, 4),))
    assert cap.method is CaptureMethod.EXPORT
    graph_names = {n for n, _ in cap.gm.named_buffers()} | {
        str(n.target) for n in cap.gm.graph.nodes if n.op == "get_attr"}
    extra = graph_names - {n for n, _ in model.named_parameters()} - {n for n, _ in model.named_buffers()}
    assert extra, "expected torch.export to add a constant the model does not have"
    assert all(cap.names.public(n) is None for n in extra)
    assert cap.names.public("fc.weight") == "fc.weight"


def test_a_replayed_plan_carries_the_tensor_split_asked_and_sequence_parallelism() -> None:
    from types import SimpleNamespace

    from pipecut.planning.asked import replay_groups

    def carried(recorded: pipecut.TensorParallelOptions) -> pipecut.TensorParallelOptions | None:
        plan = SimpleNamespace(options=Options(tensor_parallel=recorded))  # what replay_groups reads of a plan
        return replay_groups(plan, tensor_parallel=None)[0]["tensor_parallel"]  # type: ignore[arg-type]

    tokens = pipecut.TensorParallelOptions(sequence_parallel=True, size=2)
    assert carried(tokens) == pipecut.TensorParallelOptions(sequence_parallel=True)  # the size is the mesh's
    given = pipecut.TensorParallelOptions(plan={"blocks.*.0": "column"}, size=2)
    assert carried(given) == pipecut.TensorParallelOptions(plan={"blocks.*.0": "column"})
    assert carried(pipecut.TensorParallelOptions(size=2)) is None  # nothing asked: the model's or graph's split
