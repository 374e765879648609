"""The ``pipecut`` command, factories, plan diffs, logging and progress bars."""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipecut
from pipecut.cli import logs
from pipecut.cli.factory import SHIPPED, call_factory, load_factory
from pipecut.cli.main import build_parser, main, parse_bytes, parse_split
from pipecut.core.kinds import FrameworkKind
from pipecut.errors import InputError
from pipecut.report.diff import diff_plans, format_diff
from pipecut.schema import validate_plan_dict
from tests.browser.plans import synthetic_plan

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One real `pipecut plan` run of the MLP example, shared by the tests that read its output."""
    out = tmp_path_factory.mktemp("cli")
    argv = ["plan", "examples.mlp:build", "--devices", "2", "--microbatches", "2",
            "--schedule", "gpipe", "--memory-limit", "2GiB", "--batch-size", "8",
            "--out", str(out / "plan.json"), "--html", str(out / "plan.html"),
            "--dot", str(out / "plan.dot")]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        assert main(argv) == 0
    return out


def test_plan_writes_json_html_and_dot(planned):
    data = json.loads((planned / "plan.json").read_text())
    validate_plan_dict(data)
    plan = pipecut.Plan.from_dict(data)
    assert plan.num_stages == 2 and plan.microbatches == 2 and plan.batch_size == 8
    assert plan.schedule is pipecut.ScheduleKind.GPIPE
    assert all(d.memory_bytes == 2 * 2**30 for d in plan.devices)
    html = (planned / "plan.html").read_text()
    assert "pipecut plan of examples.mlp:build" in html
    assert all(f'data-stage="{s}"' in html for s in range(2))
    assert (planned / "plan.dot").read_text().startswith("digraph plan {")


def test_plan_accepts_a_file_path_factory(in_repo, tmp_path, capsys):
    code = main(["plan", "examples/mlp.py:build", "-k", "2", "-m", "1", "--batch-size", "2",
                 "-o", str(tmp_path / "p.json"), "-q"])
    assert code == 0
    assert "predicted step" in capsys.readouterr().out
    assert pipecut.Plan.from_json(tmp_path / "p.json").num_stages == 2


def test_show_prints_the_summary(planned, capsys):
    assert main(["show", str(planned / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["stage", "device", "nodes"]
    assert "predicted step" in out


def test_render_with_timeline_and_dot(planned, tmp_path, capsys):
    from pipecut.report.gantt import predicted_spans, to_trace

    plan = pipecut.Plan.from_json(planned / "plan.json")
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(to_trace(predicted_spans(plan))))
    assert main(["render", str(planned / "plan.json"), "--timeline", str(trace),
                 "-o", str(tmp_path / "r.html")]) == 0
    assert "Measured timeline" in (tmp_path / "r.html").read_text()
    assert main(["render", str(planned / "plan.json"), "-o", str(tmp_path / "r.dot")]) == 0
    assert "cluster_stage_1" in (tmp_path / "r.dot").read_text()


def test_diff_names_moved_nodes_and_the_predicted_effect(tmp_path, capsys):
    a, b = synthetic_plan(layers=6, stages=2), synthetic_plan(layers=6, stages=3)
    a.to_json(tmp_path / "a.json")
    b.to_json(tmp_path / "b.json")
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "stages: 2 → 3" in out
    assert re.search(r"\d+ node\(s\) moved between stages", out)
    assert re.search(r"layers.*stage 1 → 2", out)
    assert "predicted step" in out and "bottleneck stage" in out


def test_diff_of_a_plan_with_itself_moves_nothing():
    plan = synthetic_plan(layers=3, stages=2)
    d = diff_plans(plan, plan)
    assert d.moves == () and d.settings == () and d.same_graph
    assert "no node moved between stages" in format_diff(d)


def test_diff_groups_consecutive_moves_by_their_common_module():
    a, b = synthetic_plan(layers=6, stages=2), synthetic_plan(layers=6, stages=3)
    d = diff_plans(a, b)
    sa, sb = a.stage_of(), b.stage_of()
    moved = {n for n in sa if sa[n] != sb[n]}
    assert {n for m in d.moves for n in m.nodes} == moved
    assert all(m.module.startswith("layers") or m.module in ("head", "") or "," in m.module
               for m in d.moves)
    assert len(d.moves) < len(moved)


# --- errors and usage -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "examples.mlp"], "expected MODULE:FACTORY"),
        (["plan", "no_such_module:build"], "cannot import module 'no_such_module'"),
        (["plan", "examples.mlp:nope"], r"has no function 'nope'; its functions are \['build'\]"),
        (["plan", "missing.py:build"], "does not exist"),
        (["show", "does-not-exist.json"], "cannot read plan"),
    ],
)
def test_refused_input_exits_1_with_a_message(in_repo, argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pipecut {argv[0]}: error:")
    assert re.search(message, err)


def test_invalid_plan_field_is_reported_with_its_path(tmp_path, capsys):
    data = json.loads(synthetic_plan(layers=2, stages=2).to_json())
    data["stages"][1]["forward_ms"] = "slow"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    assert main(["show", str(tmp_path / "bad.json")]) == 1
    assert "$.stages[1].forward_ms" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "examples.mlp:build", "--memory-limit", "lots"])
    assert e.value.code == 2
    assert "write e.g. 2GiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "examples.mlp:build", "--schedule", "zigzag"])


@pytest.mark.parametrize(
    ("text", "value"),
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1000", 1000),
     ("64 kib", 65536)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_refuses_nonsense():
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("2 parsecs")


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "pipecut", "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    for command in ("plan", "show", "diff", "render"):
        assert command in out.stdout


# --- factories --------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SHIPPED)
def test_shipped_factories_load(in_repo, spec):
    example = call_factory(load_factory(spec), batch_size=4, seed=1, spec=spec)
    assert isinstance(example.model, __import__("torch").nn.Module)
    assert isinstance(example.inputs, tuple) and example.loss_fn is not None


def test_factory_must_return_the_four_things(tmp_path, monkeypatch):
    (tmp_path / "bad_factory.py").write_text("def build():\n    return 1, 2, 3\n")
    monkeypatch.chdir(tmp_path)
    fn = load_factory("bad_factory.py:build")
    with pytest.raises(InputError, match=r"must return \(model, example_inputs, loss_fn, target\)"):
        call_factory(fn, spec="bad_factory.py:build")
    with pytest.raises(InputError, match="does not take batch_size="):
        call_factory(fn, batch_size=4, spec="bad_factory.py:build")


# --- logging and progress ---------------------------------------------------------------------
def test_log_lines_carry_the_rank():
    stream = io.StringIO()
    logger = logs.configure(1, rank=3, stream=stream)
    logging.getLogger("pipecut.test").warning("stage %d is slow", 2)
    assert stream.getvalue() == "[rank 3] WARNING pipecut.test: stage 2 is slow\n"
    assert logger.level == logging.WARNING  # -v is info on rank 0 only
    logs.configure(0, rank=0, stream=io.StringIO())


@pytest.mark.parametrize(
    ("verbosity", "rank", "level"),
    [(-1, 0, logging.ERROR), (0, 0, logging.WARNING), (1, 0, logging.INFO), (2, 0, logging.DEBUG),
     (1, 1, logging.WARNING), (2, 1, logging.DEBUG), (-1, 1, logging.ERROR)],
)
def test_verbosity_levels(verbosity, rank, level):
    assert logs.level_for(verbosity, rank) == level


def test_verbose_flag_works_before_and_after_the_command(planned, capsys):
    for argv in (["-v", "show"], ["show", "-v"]):
        main([*argv, str(planned / "plan.json")])
        assert logging.getLogger("pipecut").level == logging.INFO
    main(["show", "-q", str(planned / "plan.json")])
    assert logging.getLogger("pipecut").level == logging.ERROR
    logs.configure(0, rank=0)


def test_progress_bar_draws_only_when_enabled():
    shown, hidden = io.StringIO(), io.StringIO()
    with logs.progress("profiling", enabled=True, stream=shown) as cb:
        for i in range(5):
            cb(i + 1, 5)
    with logs.progress("profiling", enabled=False, stream=hidden) as cb:
        cb(1, 5)
    assert "profiling" in shown.getvalue() and "/5 " in shown.getvalue()
    assert hidden.getvalue() == ""


def test_progress_only_on_a_terminal_of_rank_0():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert logs.show_progress(0, Tty())
    assert not logs.show_progress(1, Tty())
    assert not logs.show_progress(0, io.StringIO())
    assert not logs.show_progress(0, Tty(), verbosity=-1)



# --- options added for issue 13 ---------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"pipecut {pipecut.__version__}"


def test_plan_for_a_device_profile_estimates_without_profiling(in_repo, tmp_path, monkeypatch):
    from pipecut.capture import capture, fingerprint
    from pipecut.core.kinds import CostSource
    from pipecut.profile.devices import device_link, device_profile

    monkeypatch.setattr(pipecut.planning.request, "profile", lambda *a, **k: pytest.fail("profiled"))
    out = tmp_path / "a100.json"
    assert main(["plan", "examples.mlp:build", "-k", "2", "-m", "2", "--batch-size", "8",
                 "--device-profile", "a100-80gb", "-o", str(out), "-q"]) == 0
    plan = pipecut.Plan.from_json(out)
    validate_plan_dict(json.loads(out.read_text()))
    assert [d.name for d in plan.devices] == ["A100-80GB"] * 2
    assert plan.devices[0].memory_bytes == device_profile("A100-80GB").memory_bytes
    assert plan.link == device_link("A100-80GB")
    assert {n.source for n in plan.nodes} == {CostSource.ESTIMATED}
    from examples import mlp

    model, (x,), _, _ = mlp.build(batch_size=8)
    assert plan.fingerprint == fingerprint(capture(model, (x[:4],)).gm)  # replayable


def test_plan_flags_land_in_the_options_the_plan_records(in_repo, tmp_path, monkeypatch):
    from pipecut.profile.calibrate import stage_times

    # the stages "compiled" by timing them eager: the flag's path, without inductor's minutes
    monkeypatch.setattr(pipecut.planning.planner, "compiled_stage_times",
                        lambda *a, **k: (stage_times(*a, **k), 0.0))
    out = tmp_path / "p.json"
    assert main(["plan", "examples.mlp:build", "-k", "2", "-m", "2", "--batch-size", "8", "--schedule",
                 "1f1b", "--compile-stages", "on", "--solver", "cbc", "-o", str(out), "-q"]) == 0
    plan = pipecut.Plan.from_json(out)
    options = plan.options
    assert options.runtime.compile_stages is True and "stages priced compiled" in plan.solver.detail
    assert options.partition.solver.value == "cbc" and options.microbatches == 2


def test_plan_link_stages_per_rank_no_calibrate_and_solver(in_repo, tmp_path):
    out = tmp_path / "p.json"
    assert main(["plan", "examples.mlp:build", "-k", "2", "-m", "4", "--batch-size", "8",
                 "--schedule", "interleaved-1f1b", "--stages-per-rank", "2",
                 "--link", "25GB,0.01", "--no-calibrate", "--memory-limit", "1GiB",
                 "--solver", "cbc", "-o", str(out), "-q"]) == 0
    plan = pipecut.Plan.from_json(out)
    assert plan.num_stages == 4 and plan.stages_per_rank == 2 and plan.num_ranks == 2
    assert plan.link.bandwidth_bytes_per_ms == 25e6 and plan.link.latency_ms == 0.01
    assert "calibrated" not in plan.solver.detail
    assert "ILP (CBC," in plan.solver.detail


def test_plan_chunks_a_heavy_head_unless_told_not_to(in_repo, tmp_path, monkeypatch):
    import dataclasses

    from pipecut.capture.modes import describe_graph
    from pipecut.passes.partition.chain import is_unit

    def profile(captured, inputs, **_):  # set costs: the head 500 ms, any piece its share
        rows = describe_graph(captured, inputs)
        pieces = sum(n.name.startswith("lm_head_piece") for n in rows)
        def ms(name: str) -> float:
            if name.startswith("lm_head_piece"):
                return 500.0 / pieces
            return 500.0 if name == "lm_head" and not pieces else 1.0
        return tuple(dataclasses.replace(n, forward_ms=ms(n.name)) if is_unit(n) else n for n in rows)

    monkeypatch.setattr(pipecut.planning.request, "profile", profile)  # the whole graph and the pieces
    common = ["plan", "examples.gpt:build", "-k", "4", "-m", "4", "--batch-size", "8", "--no-calibrate", "-q"]
    assert main([*common, "-o", str(tmp_path / "a.json")]) == 0
    assert main([*common, "--no-chunk-heavy", "-o", str(tmp_path / "b.json")]) == 0
    chunked, whole = (pipecut.Plan.from_json(tmp_path / f) for f in ("a.json", "b.json"))
    assert [c.node for c in chunked.chunked] == ["lm_head"] and whole.chunked == ()
    assert max(chunked.predicted.stage_ms) < 500.0 <= max(whole.predicted.stage_ms)


def test_show_and_diff_as_json(tmp_path, capsys):
    a, b = synthetic_plan(layers=6, stages=2), synthetic_plan(layers=6, stages=3)
    a.to_json(tmp_path / "a.json")
    b.to_json(tmp_path / "b.json")
    assert main(["show", str(tmp_path / "a.json"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [s["index"] for s in shown["stages"]] == [0, 1]
    assert shown["predicted"]["step_ms"] == a.predicted.step_ms
    assert shown["stages"][1]["nodes"] == len(a.stages[1].nodes)
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json"]) == 0
    diff = json.loads(capsys.readouterr().out)
    expected = diff_plans(a, b)
    assert diff["moved_nodes"] == expected.moved_nodes > 0
    assert ["stages", "2", "3"] in diff["settings"]
    assert diff["step_ms"] == list(expected.step_ms)


def test_render_refuses_svg_and_missing_folders(tmp_path, capsys):
    path = tmp_path / "p.json"
    synthetic_plan(layers=2, stages=2).to_json(path)
    assert main(["render", str(path), "-o", str(tmp_path / "x.svg")]) == 1
    err = capsys.readouterr().err
    assert "cannot write a .svg file; use one of ['.html', '.htm', '.dot', '.gv']" in err
    assert "dot -Tsvg" in err and not (tmp_path / "x.svg").exists()
    assert main(["render", str(path), "-o", str(tmp_path / "nope" / "x.html")]) == 1
    assert "does not exist; create it first" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--out", "no/such/folder/plan.json"], r"--out no/such/folder/plan.json: the folder no/such/folder does not exist"),
        (["--html", "missing-dir/p.html"], "the folder missing-dir does not exist"),
        (["--stages-per-rank", "2"], "--stages-per-rank 2 needs --schedule interleaved-1f1b"),
        (["--device-profile", "Z80"], r"no device profile named 'Z80'; choose one of \['A100-40GB'"),
    ],
)
def test_plan_refuses_bad_options_before_profiling(in_repo, monkeypatch, capsys, extra, message):
    monkeypatch.setattr("pipecut.cli.main.load_factory", lambda *a: pytest.fail("got to the model"))
    assert main(["plan", "examples.mlp:build", *extra]) == 1
    assert re.search(message, capsys.readouterr().err)


def test_plan_refuses_a_folder_it_cannot_write(in_repo, tmp_path, monkeypatch, capsys):
    import os

    if os.geteuid() == 0:
        # root writes anywhere: check the refusal through the access check itself
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    else:
        tmp_path.chmod(0o500)
    monkeypatch.setattr("pipecut.cli.main.load_factory", lambda *a: pytest.fail("got to the model"))
    assert main(["plan", "examples.mlp:build", "--out", str(tmp_path / "p.json")]) == 1
    assert "cannot write there (permission denied)" in capsys.readouterr().err


@pytest.mark.parametrize("link", ["fast", "25GB,-1", "0,0.1", "25GB,soon"])
def test_bad_link_is_a_usage_error(link, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "examples.mlp:build", "--link", link])
    assert e.value.code == 2
    assert "write BANDWIDTH[,LATENCY_MS]" in capsys.readouterr().err


def test_plan_with_a_pinned_split_and_auto_microbatches(in_repo, tmp_path, capsys):
    assert parse_split("layers.2,layers.4") == ["layers.2", "layers.4"]
    assert parse_split("layers.0,layers.1|layers.2,head") == [["layers.0", "layers.1"], ["layers.2", "head"]]
    code = main(["plan", "examples.mlp:build", "-k", "2", "-m", "auto", "-s", "auto", "--batch-size", "8",
                 "--split", "layers.5", "--no-calibrate", "-o", str(tmp_path / "p.json"), "-q"])
    assert code == 0
    plan = pipecut.Plan.from_json(tmp_path / "p.json")
    assert plan.solver.method is pipecut.Partitioner.GIVEN
    assert plan.stages[1].nodes[0].startswith("layers_5") and plan.candidates
    assert plan.predicted.optimum_step_ms > 0  # pipecut's own split, priced beside the given one
    assert main(["plan", "examples.mlp:build", "-m", "auto", "--device-profile", "A100-80GB", "-q"]) == 1
    assert "not 'auto'" in capsys.readouterr().err


def test_plan_measures_on_the_gpu_when_there_is_one(monkeypatch):
    from pipecut.cli.main import measure_on

    assert measure_on("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert measure_on(None) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert measure_on(None) is None  # where the factory's inputs are
    assert build_parser().parse_args(["plan", "examples.mlp:build", "--measure-on", "meta"]).measure_on == "meta"


def test_plan_for_a_cluster_writes_the_run_and_placement(in_repo, tmp_path, capsys):
    out, html = tmp_path / "cluster.json", tmp_path / "cluster.html"
    assert main(["plan", "examples.mlp:build", "-m", "2", "--batch-size", "8",
                 "--cluster", "2x2xH100-SXM", "--data-parallel", "auto", "--recompute", "none", "-o", str(out),
                 "--html", str(html), "-q"]) == 0
    plan = pipecut.Plan.from_json(out)
    validate_plan_dict(json.loads(out.read_text()))
    assert plan.cluster is not None and plan.cluster.spec == "2x2xH100-SXM"
    assert plan.placement is not None and plan.run is not None and plan.run.recompute == "none"
    assert "cluster 2x2xH100-SXM" in capsys.readouterr().out
    assert "gpu-grid" in html.read_text()
    assert main(["show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["cluster"] == "2x2xH100-SXM" and shown["run"]["mfu"] == plan.run.mfu
    assert len(shown["placement"]["gpus"]) == 4


def test_plan_for_a_cluster_with_tensor_parallelism(in_repo, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["plan", "examples.mlp:build", "-m", "2", "--batch-size", "8", "--cluster", "1x4xH100-SXM",
                 "--tensor-parallel", "2", "--recompute", "none", "-o", str(out), "-q"]) == 0
    plan = pipecut.Plan.from_json(out)
    validate_plan_dict(json.loads(out.read_text()))
    assert plan.placement is not None and plan.placement.tensor_parallel == 2
    assert "x tensor parallel 2" in capsys.readouterr().out
    assert main(["show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["placement"]
    assert shown["tensor_parallel"] == 2 and [0, 1] in shown["tensor_groups"] and len(shown["gpus"]) == 4


def test_plan_for_a_cluster_as_another_framework_runs_it(in_repo, tmp_path, capsys):
    out = tmp_path / "megatron.json"
    assert main(["plan", "examples.mlp:build", "-m", "2", "--batch-size", "8", "--cluster", "1x2xH100-SXM",
                 "--framework", "megatron", "-o", str(out), "-q"]) == 0
    plan = pipecut.Plan.from_json(out)
    assert plan.run is not None and plan.run.framework is FrameworkKind.MEGATRON
    assert "priced as megatron runs" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--tensor-parallel", "2"], "--tensor-parallel 2 plans tensor parallelism for a cluster: add --cluster"),
    (["--cluster", "8x8"], "cannot read cluster '8x8'"),
    (["--framework", "megatron"], "--framework megatron prices a cluster plan as that framework runs it: add --cluster"),
    (["--cluster", "1x2xH100-SXM", "--device-profile", "A100-80GB"], "--cluster names the device"),
    (["-k", "4", "--device-profile", "A100-80GB", "--data-parallel", "auto"],
     "or plan the run for that hardware with --cluster 1x4xA100-80GB"),
])
def test_cluster_flag_errors(in_repo, argv, message, capsys):
    assert main(["plan", "examples.mlp:build", "-m", "2", *argv, "-q"]) == 1
    assert message in capsys.readouterr().err


# Every flag of `pipecut plan` that sets an option of `pipecut.plan`: the option's dotted path on
# `pipecut.options.Options`, a value to pass, and what the option must then hold. The other flags
# say what they are instead. A new flag must be put in one table or the other (checked below),
# and a renamed option field fails the path check.
FLAG_OPTIONS = {
    "--microbatches": ("microbatches", ["2"], 2),
    "--schedule": ("schedule", ["gpipe"], "gpipe"),
    "--split": ("partition.split", ["fc2"], None),  # the parsed split, compared below
    "--data-parallel": ("data_parallel.kind", ["auto"], "auto"),
    "--stages-per-rank": ("scheduling.stages_per_rank", ["2", "--schedule", "interleaved-1f1b"], 2),
    "--recompute": ("partition.recompute", ["full"], "full"),
    "--measure-on": ("measure.device", ["cpu"], "cpu"),
    "--link": ("measure.link", ["25GB,0.01"], None),
    "--no-calibrate": ("measure.calibrate", [], False),
    "--no-chunk-heavy": ("partition.heavy_pieces", [], False),
    "--solver": ("partition.solver", ["cbc"], "cbc"),
    "--compile-stages": ("runtime.compile_stages", ["on"], True),
}
NOT_OPTIONS = {
    "factory": "the model's factory", "--devices": "plan's devices (K)", "--memory-limit": "each DeviceSpec's memory",
    "--tensor-parallel": "with --cluster only: plan_cluster's T", "--cluster": "plan_cluster instead of plan",
    "--framework": "with --cluster only: plan_cluster's measure.framework",
    "--device-profile": "estimated costs and partition_costs instead of plan", "--batch-size": "the factory's argument",
    "--seed": "the factory's argument", "--out": "an output file", "--html": "an output file", "--dot": "an output file",
    "--verbose": "logging", "--quiet": "logging", "--help": "argparse",
}


def _plan_flags() -> set[str]:
    """Each argument of ``pipecut plan`` by its long name (a positional by its name)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = set()
    for action in sub.choices["plan"]._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        names.add(long[0] if long else action.option_strings[0] if action.option_strings else action.dest)
    return names


def test_every_plan_flag_is_an_option_or_says_what_it_is() -> None:
    flags = _plan_flags()
    assert flags == set(FLAG_OPTIONS) | set(NOT_OPTIONS), (
        f"unclassified: {sorted(flags - set(FLAG_OPTIONS) - set(NOT_OPTIONS))}; "
        f"gone: {sorted((set(FLAG_OPTIONS) | set(NOT_OPTIONS)) - flags)}")


@pytest.mark.parametrize("flag", sorted(FLAG_OPTIONS))
def test_a_plan_flag_reaches_the_option_it_names(flag: str, in_repo, monkeypatch) -> None:
    """The flag, parsed and handed to ``pipecut.plan`` (replaced here: nothing is measured), is
    the named field of the options that call resolves to."""
    import dataclasses

    from pipecut.cli.main import parse_link
    from pipecut.options import Options, options_of, requested

    path, value, want = FLAG_OPTIONS[flag]
    seen: list[Options] = []

    class Stop(Exception):
        pass

    def plan(model, inputs, devices, **kw):
        groups = requested(microbatches=kw.get("microbatches"), schedule=kw.get("schedule"),
                           data_parallel=kw.get("data_parallel"),
                           groups={g: kw.get(g) for g in Options.GROUPS if g != "data_parallel"})
        seen.append(options_of(groups))
        raise Stop

    monkeypatch.setattr(pipecut, "plan", plan)
    with pytest.raises(Stop):
        main(["plan", "examples.mlp:build", "--batch-size", "8", flag, *value])
    got: object = seen[0]
    for part in path.split("."):
        assert part in {f.name for f in dataclasses.fields(got)}, f"{flag}: no option field {path}"  # type: ignore[arg-type]
        got = getattr(got, part)
    from pipecut.options import PartitionOptions

    expected = {"--split": lambda: PartitionOptions(split=parse_split("fc2")).split,
                "--link": lambda: parse_link("25GB,0.01")}.get(flag, lambda: want)()
    assert got == expected or getattr(got, "value", None) == expected, (flag, got, expected)
