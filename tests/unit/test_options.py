"""pipecut.options: the options objects, their normal forms, the plan's record, the 0.1 keywords."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch

import pipecut
from examples import mlp
from pipecut.api import COMPILE_KEYWORDS
from pipecut.errors import InputError
from pipecut.options import (
    LEGACY,
    CaptureOptions,
    DataParallelOptions,
    IlpSolver,
    MeasureOptions,
    Options,
    PartitionOptions,
    ScheduleOptions,
    WeightOptions,
    requested,
)
from pipecut.parallel import DataParallel, DataParallelKind
from pipecut.plan import CaptureMethod, Plan, ScheduleKind
from pipecut.planning.partition import PARTITION_KEYWORDS, partition_costs
from pipecut.planning.planner import PLAN_KEYWORDS
from tests.unit.tiny import mlp_plan

GROUP_CLASSES = {"capture": CaptureOptions, "measure": MeasureOptions, "partition": PartitionOptions,
                 "scheduling": ScheduleOptions, "weights": WeightOptions, "runtime": pipecut.RuntimeOptions}


def test_every_old_keyword_maps_to_one_field_and_every_field_has_at_most_one_keyword() -> None:
    assert set(PLAN_KEYWORDS) | set(COMPILE_KEYWORDS) | set(PARTITION_KEYWORDS) == set(LEGACY)
    targets = list(LEGACY.values())
    assert len(set(targets)) == len(targets)  # one to one
    for old, (group, name) in LEGACY.items():
        fields = {f.name for f in dataclasses.fields(GROUP_CLASSES[group])}
        assert name in fields, f"{old}= maps to {group}.{name}, which does not exist"


@pytest.mark.parametrize("old", sorted(LEGACY))
def test_each_old_keyword_lands_on_its_field_with_a_warning_naming_it(old: str) -> None:
    group, name = LEGACY[old]
    default = getattr(GROUP_CLASSES[group](), name)
    value = {"leaf_modules": (torch.nn.Linear,), "split": ("blocks.1",), "solver": "cbc",
             "capture_method": "export", "link": pipecut.Link(bandwidth_bytes_per_ms=1.0),
             "loss_reduction": "sum", "device": "cpu", "init": print, "partitioner": "ilp"}.get(old)
    if value is None:
        value = (not default) if isinstance(default, bool) or default is None else default + 1
    accepted = [k for k in (PLAN_KEYWORDS, COMPILE_KEYWORDS) if old in k]
    where = "plan" if old in PLAN_KEYWORDS else "compile"
    with pytest.warns(DeprecationWarning, match=rf"{old}= → {group}=\w+Options\({name}=\.\.\.\)"):
        groups = requested(where, groups={}, legacy={old: value}, accepted=accepted[0] if accepted else ())
    expected = dataclasses.replace(GROUP_CLASSES[group](), **{name: value})
    assert groups[group] == expected and getattr(groups[group], name) != default


def test_an_old_plan_call_gives_the_plan_of_its_options_and_records_them() -> None:
    model, inputs, loss_fn, target = mlp.build(8, width=16, depth=3)
    common = dict(loss_fn=loss_fn, target=target, microbatches=2, schedule="1f1b")
    with pytest.warns(DeprecationWarning, match="repeats= → measure=MeasureOptions"):
        old = pipecut.plan(model, inputs, 2, repeats=1, warmup=0, calibrate=False, chunk_heavy=False, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the options path warns about nothing
        new = pipecut.plan(model, inputs, 2, measure=MeasureOptions(repeats=1, warmup=0, calibrate=False),
                           partition=PartitionOptions(heavy_pieces=False), **common)
    assert old.options == new.options
    assert new.options.measure.repeats == 1 and new.options.scheduling.kind is ScheduleKind.ONE_F_ONE_B
    asked = next(line for line in pipecut.summary(new).splitlines() if line.startswith("asked: "))
    assert asked == ("asked: measure.repeats=1, measure.warmup=0, measure.calibrate=False, "
                     "partition.heavy_pieces=False, scheduling.microbatches=2, scheduling.kind='1f1b'")


def test_old_partition_costs_keywords_give_the_same_plan() -> None:
    plan = mlp_plan()
    common = dict(devices=3, microbatches=plan.microbatches, batch_size=plan.batch_size, schedule=plan.schedule)
    with pytest.warns(DeprecationWarning, match="partition_costs"):
        old = partition_costs(plan.nodes, solver="cbc", recompute=False, **common)
    new = partition_costs(plan.nodes, partition=PartitionOptions(solver=IlpSolver.CBC, recompute=False), **common)
    assert dataclasses.replace(old, solver=new.solver) == new


def test_unknown_keywords_and_contradictions_are_refused_before_any_work() -> None:
    with pytest.raises(TypeError, match=r"plan\(\) got unexpected keyword argument\(s\) 'repeat'"):
        pipecut.plan(torch.nn.Linear(2, 2), (torch.ones(2, 2),), 1, repeat=1)
    with pytest.raises(TypeError, match=r"compile\(\) got unexpected keyword argument\(s\) 'repeats'"):
        pipecut.compile(torch.nn.Linear(2, 2), 1, example_inputs=(torch.ones(2, 2),), loss_fn=None, repeats=1)
    with pytest.raises(InputError, match=r"plan\(microbatches=4\) contradicts scheduling=ScheduleOptions\("):
        pipecut.plan(torch.nn.Linear(2, 2), (torch.ones(4, 2),), 1, microbatches=4,
                     scheduling=ScheduleOptions(microbatches=2))


def test_options_normalise_what_they_are_given_and_refuse_typos() -> None:
    assert ScheduleOptions(kind="1F1B") == ScheduleOptions(kind=ScheduleKind.ONE_F_ONE_B)
    assert ScheduleOptions(kind="auto").kind == "auto"
    assert CaptureOptions(method="export", leaf_modules=(torch.nn.Linear,)) == CaptureOptions(
        method=CaptureMethod.EXPORT, leaf_modules=("torch.nn.modules.linear.Linear",))
    assert PartitionOptions(split=[["a"], ["b"]]).split == (("a",), ("b",))
    assert DataParallelOptions(kind="FSDP", replicas=2).fixed == DataParallel(kind=DataParallelKind.FSDP, replicas=2)
    assert DataParallelOptions(kind="auto").fixed is None
    with pytest.raises(InputError, match="unknown schedule 'lifo'"):
        ScheduleOptions(kind="lifo")
    with pytest.raises(InputError, match="microbatches must be a positive int or 'auto', got 0"):
        ScheduleOptions(microbatches=0)
    with pytest.raises(InputError, match="unknown ILP solver 'glpk'"):
        PartitionOptions(solver="glpk")
    with pytest.raises(InputError, match="repeats must be >= 1"):
        MeasureOptions(repeats=0)


def test_the_plan_carries_its_options_through_json_and_reads_version_1() -> None:
    plan = mlp_plan()
    assert isinstance(plan.options, Options)
    again = Plan.from_json(plan.to_json())
    assert again.options == plan.options and again == plan
    old = json.loads(plan.to_json())
    old["format_version"] = 1
    del old["options"]  # a plan written by pipecut 0.1
    read = Plan.from_json(json.dumps(old))
    assert read.options is None and read.format_version == 2
    assert dataclasses.replace(read, options=plan.options) == plan


def test_the_options_page_runs_and_its_table_is_the_mapping() -> None:
    from tests.docs import ROOT, code

    exec(code("docs/options.md", "heavy_pieces=False"), {})  # type: ignore[arg-type]
    rows = [line for line in (ROOT / "docs" / "options.md").read_text().splitlines()
            if line.startswith("| `") and "=`" in line.split("|")[1]]
    documented = {}
    for row in rows:
        olds, now = row.split("|")[1], row.split("|")[2]
        group_class = now.split("(")[0].strip(" `")
        names = [o.strip(" `=") for o in olds.split(",")]
        fields = names if "same names" in now else re.findall(r"(\w+)=\.\.\.", now)
        documented.update((o, (group_class, f)) for o, f in zip(names, fields, strict=True))
    expected = {old: (type(GROUP_CLASSES[g]()).__name__, f) for old, (g, f) in LEGACY.items()}
    assert documented == expected
