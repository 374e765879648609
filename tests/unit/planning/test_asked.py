"""pipecut.planning.asked: one resolver, one table of defaults per context.

Every options field that may be left out has a row for every context, and resolving never
leaves a value "not given". docs/options.md prints the table. The engine a mesh gets by default
is named in refusals. A new field is added by the options class, a row and the docs: the last
test adds one and shows that nothing else has to change."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import pipecut
from pipecut.core.kinds import DataParallelKind, Recompute, ScheduleKind
from pipecut.errors import InputError
from pipecut.options import (
    AUTO,
    DataParallelOptions,
    Options,
    PartitionOptions,
    TensorParallelOptions,
)
from pipecut.passes.partition.solve import DEFAULT_LINK
from pipecut.planning import asked
from pipecut.planning.asked import DEFAULTS, FIELDS, NO_REPLICAS, Context, defaults_table, resolve
from tests.unit.tiny import Mesh

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def plan() -> pipecut.Plan:
    from examples import mlp

    model, inputs, loss_fn, target = mlp.build(batch_size=8)
    return pipecut.plan(model, inputs, devices=2, loss_fn=loss_fn, target=target, microbatches=4, schedule="1f1b",
                        measure=pipecut.MeasureOptions(estimate="A100-80GB"),
                        tensor_parallel=TensorParallelOptions(sequence_parallel=True))


def test_every_field_has_one_row_per_context() -> None:
    for name in FIELDS:
        assert sorted(d.context.value for d in DEFAULTS if d.name == name) == sorted(c.value for c in Context), name


def test_every_field_that_may_be_left_out_is_in_the_table() -> None:
    """A field whose declared default is None ("not given") and that the planner or the build reads
    must have its defaults in the table, or be one of these, which mean the same everywhere."""
    same_everywhere = {"data_parallel.replicas": "None: every D weighed (plan, cluster) or the mesh's (compile)",
                       "tensor_parallel.size": "None: every T (cluster) or the mesh's (compile)",
                       "measure.device": "None: where the inputs are", "measure.estimate": "None: timed",
                       "partition.split": "None: chosen"}
    tabled = {".".join(where) for where in FIELDS.values()}
    missing = []
    for group in Options.GROUPS:
        for f in dataclasses.fields(getattr(Options(), group)):
            name = f"{group}.{f.name}"
            if f.default is None and name not in tabled and name not in same_everywhere:
                missing.append(name)
    for f in dataclasses.fields(Options):
        if f.default is None and f.name not in tabled:
            missing.append(f.name)
    assert not missing, f"left out (None) with no row in pipecut.planning.asked.DEFAULTS: {missing}"


@pytest.mark.parametrize("context", [Context.PLAN, Context.COMPILE, Context.CLUSTER])
def test_nothing_resolves_to_not_given(context: Context) -> None:
    resolved = resolve(Options(), context)
    assert all(getattr(resolved, name) is not None for name in FIELDS)
    assert set(resolved.defaulted) == set(FIELDS)  # everything came from the table


def test_the_defaults_of_each_context() -> None:
    plan_, compile_, cluster = (resolve(Options(), c) for c in (Context.PLAN, Context.COMPILE, Context.CLUSTER))
    assert (plan_.microbatches, plan_.schedule, plan_.data_parallel, plan_.sequence_parallel) == (
        AUTO, AUTO, NO_REPLICAS, False)
    assert compile_ == dataclasses.replace(plan_, context=Context.COMPILE)
    assert (cluster.microbatches, cluster.schedule, cluster.stages_per_rank, cluster.recompute,
            cluster.sequence_parallel, cluster.data_parallel) == (
        1, ScheduleKind.ONE_F_ONE_B, AUTO, Recompute.SELECTIVE, True, AUTO)
    assert resolve(Options(microbatches=4), Context.PLAN).schedule is ScheduleKind.GPIPE
    assert resolve(Options(microbatches=4), Context.PLAN).origin("schedule") == "the default beside microbatches=4"
    assert resolve(Options(microbatches=4, schedule="auto"), Context.PLAN).schedule == AUTO
    estimated = resolve(Options(measure=pipecut.MeasureOptions(estimate="A100-80GB")), Context.PLAN).link
    assert estimated != DEFAULT_LINK and resolve(Options(), Context.PLAN).link == DEFAULT_LINK


def test_what_is_given_is_kept_and_has_no_origin() -> None:
    options = Options(microbatches=8, schedule="zbv", partition=PartitionOptions(recompute="none"),
                      tensor_parallel=TensorParallelOptions(sequence_parallel=False),
                      data_parallel=DataParallelOptions(kind="zero1"))
    r = resolve(options, Context.CLUSTER)
    assert (r.microbatches, r.schedule, r.recompute, r.sequence_parallel, r.data_parallel) == (
        8, ScheduleKind.ZBV, Recompute.NONE, False, DataParallelKind.ZERO1)
    assert r.origin("schedule") == r.origin("recompute") == r.origin("data_parallel") == ""
    with pytest.raises(InputError, match="needs microbatches as a value"):
        resolve(Options(microbatches="auto"), Context.CLUSTER)


def test_a_replay_takes_the_plans_values(plan: pipecut.Plan) -> None:
    r = resolve(Options(), Context.REPLAY, plan=plan)
    assert (r.microbatches, r.schedule, r.stages_per_rank, r.link, r.capture_method) == (
        4, ScheduleKind.ONE_F_ONE_B, 1, plan.link, plan.capture)
    assert r.sequence_parallel is True and r.origin("sequence_parallel") == "recorded in the replayed plan's options"
    with pytest.raises(InputError, match="needs the plan"):
        resolve(Options(), Context.REPLAY)


def test_a_replayed_cluster_plan_split_over_t_runs_sequence_parallelism_as_its_run_was_priced(
        plan: pipecut.Plan) -> None:
    """A cluster plan's options are what was asked (sequence_parallel None: the cluster's default,
    on); its run says what was priced, and the replay runs that, unless the call says otherwise."""
    from pipecut.cluster import ClusterPlacement, Layout, RunPrediction

    assert plan.options is not None
    asked_ = dataclasses.replace(plan.options, tensor_parallel=TensorParallelOptions())
    run = RunPrediction(step_ms=1.0, bubble_fraction=0.0, tokens_per_s_per_gpu=1.0, mfu=0.1, peak_memory_bytes=1,
                        sequence_parallel=True)
    split = dataclasses.replace(plan, options=asked_, run=run, placement=ClusterPlacement(
        layout=Layout.STAGES_INSIDE_NODES, replicas=1, stages=2, tensor_parallel=2))
    r = resolve(Options(), Context.REPLAY, plan=split)
    assert r.sequence_parallel is True and r.origin("sequence_parallel") == "the replayed cluster plan's run"
    off = Options(tensor_parallel=TensorParallelOptions(sequence_parallel=False))
    assert resolve(off, Context.REPLAY, plan=split).sequence_parallel is False
    unsplit = dataclasses.replace(split, placement=dataclasses.replace(split.placement, tensor_parallel=1))
    assert resolve(Options(), Context.REPLAY, plan=unsplit).sequence_parallel is False  # nothing split: none


def test_compile_reads_t_from_the_mesh_and_refuses_a_size_or_split_it_does_not_give() -> None:
    assert asked.tensor_group(None, Mesh(pp=2, tp=2)) == TensorParallelOptions(size=2)
    assert asked.tensor_group(TensorParallelOptions(sequence_parallel=True), 4) == TensorParallelOptions(
        sequence_parallel=True)
    with pytest.raises(InputError, match=r"size=4\) but the devices give a tp dimension of 2"):
        asked.tensor_group(TensorParallelOptions(size=4), Mesh(pp=2, tp=2))
    with pytest.raises(InputError, match=r"plan=\.\.\.\) needs a DeviceMesh with a 'tp' dimension"):
        asked.tensor_group(TensorParallelOptions(plan={"lin": "column"}), Mesh(dp=2, pp=2))


def test_replanning_leaves_out_what_the_plan_fixes() -> None:
    given = Options(microbatches=4, schedule="1f1b", scheduling=pipecut.ScheduleOptions(stages_per_rank=2),
                    measure=pipecut.MeasureOptions(repeats=3, link=DEFAULT_LINK))
    again = asked.replanned(given)
    assert (again.microbatches, again.schedule, again.scheduling, again.measure.link) == (
        None, None, pipecut.ScheduleOptions(), None)
    assert again.measure.repeats == 3 and given.microbatches == 4  # the rest kept; the input unchanged


def test_a_replay_fills_the_groups_left_out_from_the_plan(plan: pipecut.Plan) -> None:
    capture = pipecut.CaptureOptions(method="export")
    groups, whence = asked.replay_groups(plan, capture=capture, runtime=None, tensor_parallel=None)
    assert plan.options is not None
    assert groups["capture"] is capture and groups["runtime"] == plan.options.runtime
    assert groups["tensor_parallel"] == TensorParallelOptions(sequence_parallel=True)  # the size is the mesh's
    assert whence == (("runtime", "recorded in the replayed plan's options"),
                      ("tensor_parallel", "recorded in the replayed plan's options"))
    assert asked.replay_groups(None, capture=None, runtime=None) == ({"capture": None, "runtime": None}, ())


def test_the_meshs_engine_and_where_a_refusal_says_it_came_from() -> None:
    """Over a "dp" dimension DDP, FSDP2 beside a "tp" one, none for one replica; an engine asked
    for has no origin; replicas asked of devices without a "dp" dimension are refused."""
    dp, dp_tp, one = Mesh(dp=2, pp=2), Mesh(dp=2, pp=2, tp=2), Mesh(dp=1, pp=2)
    r = resolve(Options(), Context.COMPILE, devices=dp)
    assert (r.data_parallel, r.origin("data_parallel")) == (DataParallelKind.DDP,
                                                            "the default for a mesh with a 'dp' dimension")
    r = resolve(Options(), Context.COMPILE, devices=dp_tp)
    assert (r.data_parallel, r.origin("data_parallel")) == (
        DataParallelKind.FSDP, "the default for a mesh with a 'dp' dimension and tensor parallelism")
    assert resolve(Options(), Context.COMPILE, devices=one).data_parallel == NO_REPLICAS
    asked_for = resolve(Options(data_parallel=DataParallelOptions(kind="ddp")), Context.COMPILE, devices=dp_tp)
    assert (asked_for.data_parallel, asked_for.origin("data_parallel")) == (DataParallelKind.DDP, "")
    with pytest.raises(InputError, match="needs replicas: pass a DeviceMesh"):
        resolve(Options(data_parallel=DataParallelOptions(kind="fsdp")), Context.COMPILE, devices=2)


def test_docs_print_the_table() -> None:
    text = (ROOT / "docs/options.md").read_text()
    assert defaults_table() in text, "docs/options.md: paste pipecut.planning.asked.defaults_table() in"


def test_a_new_option_needs_a_field_a_row_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial knob, ``PartitionOptions.trial``: the options class gets the field (here, a
    subclass), the table its rows; resolve then reads and defaults it with no other change."""

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Partition(PartitionOptions):
        trial: int | None = None

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Trial(Options):
        partition: PartitionOptions = dataclasses.field(default_factory=Partition)

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Resolved(asked.Resolved):
        trial: int = 0

    rows = asked._rows("trial", ((Context.PLAN, Context.COMPILE, Context.REPLAY), "0", asked._const(0, "the default")),
                       ((Context.CLUSTER,), "2", asked._const(2, "the default for a cluster plan")))
    monkeypatch.setattr(asked, "Options", Trial)
    monkeypatch.setattr(asked, "Resolved", Resolved)
    monkeypatch.setattr(asked, "FIELDS", {**FIELDS, "trial": ("partition", "trial")})
    monkeypatch.setattr(asked, "DEFAULTS", (*DEFAULTS, *rows))
    assert asked.resolve(Trial(), Context.CLUSTER).trial == 2  # type: ignore[attr-defined]
    assert asked.resolve(Trial(partition=Partition(trial=5)), Context.PLAN).trial == 5  # type: ignore[attr-defined]
    assert "| `trial` (`partition.trial`) | 0 | 0 | 0 | 2 |" in asked.defaults_table()
