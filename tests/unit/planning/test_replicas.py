"""data_parallel="auto": choosing D replicas × K stages, in the plan, its JSON and its summary."""

from __future__ import annotations

import dataclasses
import json

import pytest

import pipecut
from examples import mlp
from pipecut.cli.main import main
from pipecut.cluster import Link
from pipecut.core.kinds import LeafKind, NodeOp, ScheduleKind
from pipecut.errors import InputError, PartitionError
from pipecut.ir import DeviceSpec, Leaf, NodeCost, Plan
from tests.browser.plans import TENSOR_SPEC, synthetic_nodes

FAST = Link(bandwidth_bytes_per_ms=1e9, latency_ms=0.0)
"""1 TB/s, no latency: communication is free, so replicas beat a pipeline's bubble."""
SLOW = Link(bandwidth_bytes_per_ms=1e3, latency_ms=0.0)
"""1 MB/s: all-reducing megabytes of gradients costs seconds, far more than sending activations."""
CPUS = tuple(DeviceSpec(name="cpu") for _ in range(4))
KW = {"microbatches": 4, "batch_size": 16, "schedule": ScheduleKind.ONE_F_ONE_B}


def _uniform_steps(candidates: tuple) -> dict[tuple[int, int], float]:
    return {(c.replicas, c.stages): c.step_ms for c in candidates
            if c.step_ms is not None and not c.per_stage}


def test_compute_heavy_small_parameters_choose_replicas() -> None:
    # 16 KiB per weight; every D x K does the same compute, but a pipeline idles in its bubble
    choice = pipecut.choose_replicas(synthetic_nodes(4, micro=4), devices=CPUS, link=FAST, **KW)
    assert (choice.replicas, choice.stages) == (4, 1)
    steps = _uniform_steps(choice.candidates)
    assert choice.step_ms == min(steps.values()) == steps[(4, 1)]
    assert choice.candidates[0].note == "chosen"


def test_heavy_parameters_on_a_slow_link_choose_stages() -> None:
    # 4 MiB per weight over 1 MB/s: any replica group's all-reduce outweighs the pipeline's cuts
    nodes = synthetic_nodes(4, width=1024, micro=4)
    choice = pipecut.choose_replicas(nodes, devices=CPUS, link=SLOW, per_stage=False, **KW)
    assert (choice.replicas, choice.stages) == (1, 4)
    steps = _uniform_steps(choice.candidates)
    assert choice.step_ms == min(steps.values())
    # pruned shapes (lower bound already worse) are listed with the reason, not dropped
    assert {(c.replicas, c.stages) for c in choice.candidates} == {(1, 4), (2, 2), (4, 1)}


def test_shapes_that_cannot_run_are_listed_and_none_left_is_an_error() -> None:
    # a microbatch of 16 / 8 = 2 samples splits over 1 or 2 replicas, not 4
    choice = pipecut.choose_replicas(
        synthetic_nodes(4, micro=2), devices=CPUS, link=FAST,
        **{**KW, "microbatches": 8},
    )
    assert [c.note for c in choice.candidates if c.replicas == 4] == [
        "a microbatch of 2 samples does not split over 4 replicas"]
    tiny = tuple(DeviceSpec(name="cpu", memory_bytes=1000) for _ in range(4))
    with pytest.raises(PartitionError, match=r"no way to run this model on 4 devices .*"
                                             r"give the devices more memory"):
        pipecut.choose_replicas(synthetic_nodes(4), devices=tiny, link=FAST, **KW)
    mixed = (*CPUS[:3], DeviceSpec(name="cpu", speed=2.0))
    with pytest.raises(InputError, match=r"replicas of equal devices.*DeviceMesh"):
        pipecut.choose_replicas(synthetic_nodes(4), devices=mixed, link=FAST, **KW)


@pytest.fixture(scope="module")
def auto_plans() -> dict[str, Plan]:
    out = {}
    for name, width, link in (("fast", 32, FAST), ("slow", 512, SLOW)):
        model, inputs, loss_fn, target = mlp.build(batch_size=16, width=width, depth=4)
        out[name] = pipecut.plan(
            model, inputs, 4, loss_fn=loss_fn, target=target, microbatches=4, schedule="1f1b",
            data_parallel="auto",
            measure=pipecut.MeasureOptions(link=link, calibrate=False, repeats=2, warmup=1),
        )
    return out


def test_plan_auto_picks_the_predicted_fastest_shape(auto_plans: dict[str, Plan]) -> None:
    for name, expect in (("fast", (4, 1)), ("slow", (1, 4))):
        plan = auto_plans[name]
        dp = plan.data_parallel
        assert dp is not None and (dp.replicas, plan.num_ranks) == expect, (name, pipecut.summary(plan))
        steps = _uniform_steps(plan.replica_candidates)
        assert steps[expect] == min(steps.values())
        assert plan.batch_size == 16 // dp.replicas  # one replica's share, planned at its shape
        x = next(n for n in plan.nodes if n.op is NodeOp.PLACEHOLDER)
        assert x.shape is not None and x.shape[0] == 16 // dp.replicas // plan.microbatches


def test_auto_plan_round_trips_and_is_summarised(auto_plans: dict[str, Plan]) -> None:
    plan = auto_plans["fast"]
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.replica_candidates == plan.replica_candidates
    assert again.data_parallel == plan.data_parallel
    text = pipecut.summary(plan)
    assert "data parallel: 4 replicas x 1 ranks (ddp), global batch 16" in text
    assert "replicas x stages weighed" in text and "(chosen)" in text


def test_auto_refuses_what_it_cannot_choose_with() -> None:
    model, inputs, loss_fn, target = mlp.build(batch_size=16, width=16, depth=2)
    kw = {"loss_fn": loss_fn, "target": target, "data_parallel": "auto"}
    with pytest.raises(InputError, match=r"but microbatches='auto', schedule was left out \(None\): give microbatches "
                                         r"and schedule as values"):
        pipecut.plan(model, inputs, 4, microbatches="auto", **kw)
    # a schedule left out is named as left out, not as an "auto" the user never wrote
    with pytest.raises(InputError, match=r"and schedule, but schedule was left out \(None\): give"):
        pipecut.plan(model, inputs, 4, microbatches=2, **kw)
    with pytest.raises(InputError, match=r"and schedule, but schedule='auto', stages_per_rank=2: give"):
        pipecut.plan(model, inputs, 4, microbatches=2, schedule="auto",
                     scheduling=pipecut.ScheduleOptions(stages_per_rank=2), **kw)
    with pytest.raises(InputError, match=r"unknown data_parallel 'zero'; choose one of \['ddp', 'zero1', 'fsdp', 'auto'\]"):
        pipecut.plan(model, inputs, 4, microbatches=2, **{**kw, "data_parallel": "zero"})
    with pytest.raises(InputError, match="zbv runs 2 per device"):
        pipecut.choose_replicas(synthetic_nodes(4, micro=4), devices=CPUS, link=FAST,
                                **{**KW, "schedule": "zbv"})


def test_cli_data_parallel_auto(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", "examples.mlp:build", "-k", "4", "-m", "2", "--batch-size", "8",
                 "--data-parallel", "auto", "--no-calibrate", "--link", "1TB", "-o", str(out)])
    assert code == 0
    assert "replicas x stages weighed" in capsys.readouterr().out
    assert main(["show", "--json", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)
    d, k = shown["data_parallel"]["replicas"], len(shown["stages"])
    assert d * k == 4 and shown["replica_candidates"][0]["note"] == "chosen"


def test_a_data_parallel_plan_records_its_replicas() -> None:
    # the mesh path (compile with a ("dp", "pp") DeviceMesh) plans with DataParallel: recorded
    from pipecut.core.kinds import DataParallelKind
    from pipecut.options import DataParallelOptions

    dp = DataParallelOptions(kind=DataParallelKind.FSDP, replicas=2)
    plan = pipecut.partition_costs(synthetic_nodes(2), devices=2, data_parallel=dp, **KW)
    assert Plan.from_json(plan.to_json()).data_parallel == dp
    assert dataclasses.replace(plan, data_parallel=None).data_parallel is None


def _heavy_light() -> list[NodeCost]:
    """x -> a (9 ms, 3 gradient bytes) -> b (3 ms, 12 bytes): tests/unit/passes/parallel/test_replication.py's
    HEAVY_LIGHT as a cost table, activations of no size."""
    leaf = (Leaf(kind=LeafKind.TENSOR, shape=(12, 1), dtype="float32", requires_grad=True),)

    def node(name: str, op: NodeOp, inputs: tuple[str, ...], fwd: float = 0.0, params: int = 0) -> NodeCost:
        return NodeCost(name=name, op=op, target=name, module=name, inputs=inputs, forward_ms=fwd,
                        backward_ms=2 * fwd, param_bytes=params, shape=(12, 1), dtype="float32",
                        leaves=leaf, treespec=TENSOR_SPEC,
                        parameters=(f"{name}.weight",) if params else ())

    return [node("x", NodeOp.PLACEHOLDER, ()), node("a", NodeOp.CALL_MODULE, ("x",), 3.0, 3),
            node("b", NodeOp.CALL_MODULE, ("a",), 1.0, 12), node("output", NodeOp.OUTPUT, ("b",))]


def test_uneven_replicas_per_stage_are_listed_never_chosen() -> None:
    # By hand in tests/unit/passes/parallel/test_replication.py: uniform 2 x 2 takes 22.5 ms, 4 x 1 34.5 ms, and
    # three replicas of a and one of b 19 ms; the runtime cannot run the last, so 2 x 2 is chosen.
    choice = pipecut.choose_replicas(
        _heavy_light(), devices=CPUS, microbatches=4, batch_size=48, schedule=ScheduleKind.GPIPE,
        link=Link(bandwidth_bytes_per_ms=1e30), allreduce=Link(bandwidth_bytes_per_ms=1.0),
    )
    assert (choice.replicas, choice.stages) == (2, 2) and choice.step_ms == pytest.approx(22.5)
    uneven = [c for c in choice.candidates if c.per_stage]
    assert [(c.per_stage, c.stages) for c in uneven] == [((3, 1), 2)]
    assert uneven[0].step_ms == pytest.approx(19.0) and "prediction only" in uneven[0].note
