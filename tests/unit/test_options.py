"""pipecut.options: the options objects, their normal forms, the plan's record."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import pipecut
from examples import mlp
from pipecut.core.kinds import CaptureMethod, DataParallelKind, Partitioner, Recompute, ScheduleKind
from pipecut.errors import InputError
from pipecut.ir import FORMAT_VERSION, Plan
from pipecut.options import (
    UNBOUNDED,
    CaptureOptions,
    DataParallelOptions,
    MeasureOptions,
    Options,
    PartitionOptions,
    ScheduleOptions,
    WeightOptions,
    schedule_origin,
)
from pipecut.passes.partition.solve import partition_costs
from tests.unit.tiny import mlp_plan

GROUP_CLASSES = {"capture": CaptureOptions, "measure": MeasureOptions, "partition": PartitionOptions,
                 "scheduling": ScheduleOptions, "weights": WeightOptions, "runtime": pipecut.RuntimeOptions}


def test_a_plan_records_its_options_and_the_summary_says_what_differs_from_the_defaults() -> None:
    model, inputs, loss_fn, target = mlp.build(8, width=16, depth=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the options path warns about nothing
        new = pipecut.plan(model, inputs, 2, measure=MeasureOptions(repeats=1, warmup=0, calibrate=False),
                           partition=PartitionOptions(heavy_pieces=False), loss_fn=loss_fn, target=target,
                           microbatches=2, schedule="1f1b")
    assert new.options.measure.repeats == 1 and new.options.schedule is ScheduleKind.ONE_F_ONE_B
    asked = next(line for line in pipecut.summary(new).splitlines() if line.startswith("asked: "))
    assert asked == ("asked: microbatches=2, schedule='1f1b', measure.repeats=1, measure.warmup=0, "
                     "measure.calibrate=False, partition.heavy_pieces=False")


def test_unknown_keywords_are_refused_before_any_work() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'repeat'"):
        pipecut.plan(torch.nn.Linear(2, 2), (torch.ones(2, 2),), 1, repeat=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'repeats'"):
        pipecut.compile(torch.nn.Linear(2, 2), (torch.ones(2, 2),), 1, loss_fn=None, repeats=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'microbatches'"):
        ScheduleOptions(microbatches=2)  # type: ignore[call-arg]  # one spelling: plan(microbatches=)


def test_options_normalise_what_they_are_given_and_refuse_typos() -> None:
    assert Options(schedule="1F1B") == Options(schedule=ScheduleKind.ONE_F_ONE_B)
    assert Options(schedule="auto").schedule == "auto"
    assert CaptureOptions(method="export", leaf_modules=(torch.nn.Linear,)) == CaptureOptions(
        method=CaptureMethod.EXPORT, leaf_modules=("torch.nn.modules.linear.Linear",))
    assert PartitionOptions(split=[["a"], ["b"]]).split == (("a",), ("b",))
    assert DataParallelOptions(kind="FSDP", replicas=2) == DataParallelOptions.resolved(DataParallelKind.FSDP, 2)
    assert not DataParallelOptions(kind="auto").is_resolved
    with pytest.raises(InputError, match="unknown schedule 'lifo'"):
        Options(schedule="lifo")
    with pytest.raises(InputError, match="microbatches must be a positive int or 'auto', got 0"):
        Options(microbatches=0)
    with pytest.raises(InputError, match=r"ScheduleOptions\(stages_per_rank=0\)"):
        ScheduleOptions(stages_per_rank=0)
    with pytest.raises(InputError, match="unknown ILP solver 'glpk'"):
        PartitionOptions(solver="glpk")
    with pytest.raises(InputError, match="repeats must be >= 1"):
        MeasureOptions(repeats=0)


def test_the_plan_carries_its_options_through_json_and_reads_versions_1_to_3() -> None:
    plan = mlp_plan()
    assert isinstance(plan.options, Options)
    again = Plan.from_json(plan.to_json())
    assert again.options == plan.options and again == plan
    old = json.loads(plan.to_json())
    old["format_version"] = 1
    del old["options"]  # a plan written before options were recorded
    read = Plan.from_json(json.dumps(old))
    assert read.options is None and read.format_version == FORMAT_VERSION
    assert dataclasses.replace(read, options=plan.options) == plan
    for was, now in ((None, "auto"), (True, Recompute.FULL), (False, Recompute.NONE)):
        v2 = json.loads(plan.to_json())
        v2["format_version"] = 2
        v2["options"]["partition"]["recompute"] = was  # version 2 wrote the recompute as a bool
        read = Plan.from_json(json.dumps(v2))
        assert read.options.partition.recompute == now and read.format_version == FORMAT_VERSION
    v3 = json.loads(plan.to_json())
    v3["format_version"] = 3
    scheduling = v3["options"]["scheduling"]
    scheduling["microbatches"], scheduling["kind"] = v3["options"].pop("microbatches"), v3["options"].pop("schedule")
    assert Plan.from_json(json.dumps(v3)) == plan  # version 3 kept them in options.scheduling


def test_a_version_5_plan_with_no_time_limit_reads_as_unbounded() -> None:
    """Version 5 wrote ``CaptureOptions(time_limit=None)`` (no bound) as null; version 6 names
    it "unbounded", None in the options only ever meaning "not given"."""
    plan = mlp_plan()
    v5 = json.loads(plan.to_json())
    v5["format_version"] = 5
    v5["options"]["capture"]["time_limit"] = None
    read = Plan.from_json(json.dumps(v5))
    assert read.options.capture.time_limit == UNBOUNDED and read.format_version == FORMAT_VERSION
    unbounded = dataclasses.replace(plan.options.capture, time_limit=UNBOUNDED)
    assert read == dataclasses.replace(plan, options=dataclasses.replace(plan.options, capture=unbounded))
    assert Plan.from_json(read.to_json()) == read  # and version 6 writes it by name
    v5["options"]["capture"]["time_limit"] = 12.0  # seconds are read as they were
    assert Plan.from_json(json.dumps(v5)).options.capture.time_limit == 12.0


def test_the_options_page_runs() -> None:
    from tests.docs import code

    exec(code("docs/options.md", "heavy_pieces=False"), {})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [*Options.GROUPS, "weights"])
def test_the_options_page_lists_every_field_of_every_group(name: str) -> None:
    """The table of docs/options.md is written by hand; a new field missing from it fails here
    (found by adding one on a branch: nothing else would have said so)."""
    from pathlib import Path

    cls = type(getattr(Options(), name)) if name != "weights" else WeightOptions
    rows = [line for line in (Path(__file__).resolve().parents[2] / "docs/options.md").read_text().splitlines()
            if line.startswith(f"| `{cls.__name__}` |")]
    assert len(rows) == 1, f"docs/options.md has no row (or several) for {cls.__name__}"
    fields_cell = rows[0].split(" | ")[2]
    missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in fields_cell]
    assert not missing, f"docs/options.md's {cls.__name__} row does not name {missing}"


def test_auto_is_one_value_for_every_choice_the_planner_can_make() -> None:
    assert CaptureOptions().method == PartitionOptions().partitioner == "auto"
    assert CaptureOptions(method="EXPORT").method is CaptureMethod.EXPORT
    assert PartitionOptions(partitioner="ilp").partitioner is Partitioner.ILP
    with pytest.raises(InputError, match=r"choose one of \['symbolic_trace', 'export', 'auto'\]"):
        CaptureOptions(method=None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"choose one of \['dp', 'ilp', 'given', 'auto'\]"):
        PartitionOptions(partitioner=None)  # type: ignore[arg-type]


def test_recompute_is_a_level_or_auto() -> None:
    assert PartitionOptions().recompute == "auto"
    assert PartitionOptions(recompute="FULL").recompute is Recompute.FULL
    with pytest.raises(InputError, match=r"unknown recompute True; choose one of \['none', 'full', 'selective', 'auto'\]"):
        PartitionOptions(recompute=True)
    with pytest.raises(InputError, match=r"recompute='selective'\) fixes the level of a cluster plan"):
        partition_costs(mlp_plan().nodes, devices=2, microbatches=2, batch_size=8,
                        partition=PartitionOptions(recompute="selective"))


def test_a_schedule_not_asked_by_name_is_named_by_where_it_came_from() -> None:
    """A refusal says after a plan's schedule how it was arrived at when the plan records that it
    was not asked for by name (issue 42: a refusal names what the user asked for)."""
    assert schedule_origin(Options(schedule="zero-bubble")) == ""  # asked
    assert schedule_origin(None) == ""  # nothing recorded: named as it is
    assert schedule_origin(Options(schedule="auto")) == " (chosen by schedule='auto')"
    assert schedule_origin(Options()) == " (chosen by schedule='auto', the default)"
    assert schedule_origin(Options(microbatches="auto")) == " (chosen by schedule='auto', the default)"
    assert schedule_origin(Options(microbatches=4)) == " (the default beside microbatches=4)"
    assert schedule_origin(Options(microbatches=4, data_parallel=DataParallelOptions(kind="auto"))) == \
        " (the default beside data_parallel='auto')"
