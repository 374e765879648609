"""The ``pipecut`` command (also ``python -m pipecut``): plan, show, diff and render plans.

    pipecut plan examples.gpt:build --devices 4 --microbatches 8 --schedule 1f1b \\
        --memory-limit 2GiB --out plan.json --html plan.html
    pipecut plan examples.gpt:build --devices 8 --device-profile A100-80GB   # not-here hardware
    pipecut show plan.json [--json]
    pipecut diff a.json b.json [--json]
    pipecut render plan.json --timeline trace.json -o plan.html     # or -o plan.dot

``MODULE:FACTORY`` names a function returning ``(model, example_inputs, loss_fn, target)``;
see :mod:`pipecut.cli.factory`. Exit status: 0 on success, 1 when pipecut refuses the input (the
message says why and how to fix it), 2 for bad command-line usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

from pipecut.cli import logs
from pipecut.cli.factory import SHIPPED, call_factory, load_factory
from pipecut.cluster import Link
from pipecut.core.kinds import FrameworkKind, ScheduleKind
from pipecut.errors import InputError, PipecutError
from pipecut.ir import DeviceSpec, Plan
from pipecut.report.text import summary

__all__ = [
    "build_parser",
    "check_output",
    "cmd_diff",
    "cmd_plan",
    "cmd_render",
    "cmd_show",
    "main",
    "measure_on",
    "parse_bytes",
    "parse_link",
    "summary_data",
]

log = logging.getLogger("pipecut.cli.main")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``2GiB`` → 2147483648; ``1.5GB`` → 1500000000; a bare number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size; write e.g. 2GiB, 512MiB, 1.5GB or a number of bytes"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def _count_or_auto(text: str) -> int | str:
    """A positive integer, or "auto" (the planner chooses)."""
    return "auto" if text == "auto" else _positive(text)


def parse_split(text: str) -> list[str] | list[list[str]]:
    """``--split``: "blocks.2,blocks.4" (modules where stages 1.. begin) or
    "tok_emb,blocks.0|blocks.1,lm_head" (module names per stage, stages separated by "|")."""
    if "|" in text:
        return [[m.strip() for m in stage.split(",") if m.strip()] for stage in text.split("|")]
    return [m.strip() for m in text.split(",") if m.strip()]


def _auto_or_positive(text: str) -> str | int:
    """``auto`` or a positive integer (``--tensor-parallel``)."""
    return "auto" if text == "auto" else _positive(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_link(text: str) -> Link:
    """``25GB,0.01`` → 25 GB/s and 0.01 ms per message; the latency may be left out (0)."""
    bandwidth, _, latency = text.partition(",")
    try:
        per_s = parse_bytes(bandwidth)
        latency_ms = float(latency) if latency.strip() else 0.0
    except (argparse.ArgumentTypeError, ValueError):
        per_s, latency_ms = 0, -1.0
    if per_s <= 0 or latency_ms < 0:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a link; write BANDWIDTH[,LATENCY_MS] with the bandwidth "
            f"in bytes per second, e.g. 25GB,0.01 (25 GB/s, 10 µs per message)"
        )
    return Link(bandwidth_bytes_per_ms=per_s / 1e3, latency_ms=latency_ms)


_RENDERED = (".html", ".htm", ".dot", ".gv")


def check_output(path: str | None, option: str, suffixes: tuple[str, ...] = ()) -> None:
    """Refuse an output path that cannot be written, before any slow work starts."""
    if path is None:
        return
    out = Path(path)
    if suffixes and out.suffix.lower() not in suffixes:
        hint = (" (for SVG, write .dot and run `dot -Tsvg plan.dot -o plan.svg`)"
                if out.suffix.lower() == ".svg" else "")
        raise InputError(
            f"{option} {path}: cannot write a {out.suffix or 'suffix-less'} file; "
            f"use one of {list(suffixes)}{hint}"
        )
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{option} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise InputError(f"{option} {path}: cannot write there (permission denied)")


def _load(path: str) -> Plan:
    plan = Plan.from_json(Path(path))
    log.info("loaded %s: %d stages, %d nodes", path, plan.num_stages, len(plan.nodes))
    return plan


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=1, sort_keys=True, default=lambda o: getattr(o, "value", str(o))))


# --- commands ---------------------------------------------------------------------------------
def _plan_estimated(args: argparse.Namespace, example: Any, link: Link | None) -> Plan:
    """Plan for a device profile: costs from FLOPs and bytes, no timing here (pipecut.profile.devices)."""
    import pipecut
    from pipecut.capture import fingerprint
    from pipecut.core.batching import first_microbatch
    from pipecut.profile.devices import estimate_captured

    # the capture comes back too, for the fingerprint that lets the plan be replayed
    captured, nodes = estimate_captured(
        example.model, example.inputs, args.device_profile, microbatches=args.microbatches,
        loss_fn=example.loss_fn, target=example.target,
    )
    size, _ = first_microbatch(example.inputs, args.microbatches)
    devices = [dataclasses.replace(d, memory_bytes=args.memory_limit or d.memory_bytes)
               for d in pipecut.device_specs(args.device_profile, args.devices)]
    return pipecut.partition_costs(
        nodes, devices=devices, link=link or pipecut.device_link(args.device_profile),
        microbatches=args.microbatches, batch_size=size, schedule=args.schedule,
        stages_per_rank=args.stages_per_rank, partition=partition_options(args),
        fingerprint=fingerprint(captured.gm), capture=captured.method,
        inputs=captured.input_names,
    )


def partition_options(args: argparse.Namespace) -> Any:
    """The partition flags as :class:`~pipecut.options.PartitionOptions`."""
    from pipecut.options import PartitionOptions

    return PartitionOptions(solver=args.solver, split=args.split, heavy_pieces=getattr(args, "chunk_heavy", True),
                            recompute=getattr(args, "recompute", "auto"))


def measure_on(asked: str | None) -> str | None:
    """Where ``pipecut plan`` times the nodes: the device asked for, else the GPU when there is
    one (a plan for GPUs measured on the CPU would be a plan for the CPU), else None (where the
    factory's inputs are)."""
    if asked is not None:
        return asked
    import torch

    return "cuda" if torch.cuda.is_available() else None


def cmd_plan(args: argparse.Namespace) -> int:
    """``pipecut plan``: check the flags, build the model, plan (for a cluster, from a device
    profile, or measured here), write the files asked for, print the summary."""
    _check_plan_args(args)  # everything that can be checked is, before the (slow) profiling starts
    example = call_factory(load_factory(args.factory), batch_size=args.batch_size, seed=args.seed,
                           spec=args.factory)
    log.info("planning %s on %d devices, %s microbatches, %s", args.factory, args.devices,
             args.microbatches, args.schedule)
    if args.cluster is not None:
        from pipecut.options import MeasureOptions, ScheduleOptions
        from pipecut.planning.cluster.plan import plan_cluster

        plan = plan_cluster(  # the flag's default of 1 stage per rank is "not given": a cluster plan weighs V
            example.model, example.inputs, args.cluster, microbatches=args.microbatches, schedule=args.schedule,
            partition=partition_options(args),
            scheduling=ScheduleOptions(stages_per_rank=args.stages_per_rank if args.stages_per_rank > 1 else None),
            loss_fn=example.loss_fn, target=example.target, tensor_parallel=args.tensor_parallel,
            measure=MeasureOptions(framework=args.framework),
        )
    elif args.device_profile is not None:
        plan = _plan_estimated(args, example, args.link)
    else:
        plan = _plan_measured(args, example)
    _write_plan(plan, args)
    print(summary(plan))
    return 0


def _check_plan_args(args: argparse.Namespace) -> None:
    from pipecut.passes.partition.solve import as_ilp_solver, as_schedule
    from pipecut.profile.devices import device_profile

    for path, flag in ((args.out, "--out"), (args.html, "--html"), (args.dot, "--dot")):
        check_output(path, flag)
    if args.device_profile is not None and "auto" in (args.microbatches, args.schedule):
        raise InputError("--device-profile plans from estimated costs at one microbatch size: give "
                         "--microbatches and --schedule as values, not 'auto'")
    if args.data_parallel is not None and args.device_profile is not None:
        raise InputError(
            f"--data-parallel auto profiles the model here: drop --device-profile, or plan the "
            f"run for that hardware with --cluster 1x{args.devices}x{args.device_profile} (D x K "
            f"with FSDP priced on its links)")
    if (args.stages_per_rank > 1 and args.schedule != "auto"
            and as_schedule(args.schedule) is not ScheduleKind.INTERLEAVED_1F1B
            and as_schedule(args.schedule).fixed_stages_per_rank != args.stages_per_rank):
        raise InputError(
            f"--stages-per-rank {args.stages_per_rank} needs --schedule interleaved-1f1b "
            f"(got {args.schedule}); use --stages-per-rank 1 otherwise"
        )
    as_ilp_solver(args.solver)
    if args.cluster is None and args.tensor_parallel not in ("auto", 1):
        raise InputError(f"--tensor-parallel {args.tensor_parallel} plans tensor parallelism for a cluster: add "
                         f"--cluster (e.g. 8x8xH100-SXM); without one the plan is the pipeline's, and compile "
                         f"splits each stage over its DeviceMesh's 'tp' dimension")
    if args.cluster is None and args.framework is not None:
        raise InputError(f"--framework {args.framework} prices a cluster plan as that framework runs it: add "
                         f"--cluster (e.g. 8x8xH100-SXM); a local plan times or estimates pipecut's own runtime")
    if args.cluster is not None:
        from pipecut.planning.cluster.figures import parse_cluster

        if args.device_profile is not None or args.microbatches == "auto":
            raise InputError("--cluster names the device and weighs D x K itself: drop "
                             "--device-profile, and give --microbatches as a value")
        parse_cluster(args.cluster)
    if args.device_profile is not None:
        device_profile(args.device_profile)


def _plan_measured(args: argparse.Namespace, example: Any) -> Any:
    """``pipecut.plan`` with the flags as options objects, the nodes measured here."""
    import pipecut
    from pipecut.options import MeasureOptions, RuntimeOptions, ScheduleOptions
    from pipecut.passes.partition.solve import DEFAULT_LINK, as_devices

    devices = [DeviceSpec(name=d.name, memory_bytes=args.memory_limit, speed=d.speed)
               for d in as_devices(args.devices)]
    compiled: bool | str = {"off": False, "on": True}.get(args.compile_stages, "auto")
    rank = logs.env_rank()
    with logs.progress("profiling", enabled=logs.show_progress(rank, verbosity=args.verbose)) as bar:
        return pipecut.plan(
            example.model, example.inputs, devices, loss_fn=example.loss_fn,
            target=example.target, microbatches=args.microbatches, schedule=args.schedule,
            progress=bar, partition=partition_options(args), data_parallel=args.data_parallel,
            scheduling=ScheduleOptions(stages_per_rank=args.stages_per_rank),
            measure=MeasureOptions(calibrate=args.calibrate, device=measure_on(args.measure_on),
                                   link=args.link or DEFAULT_LINK),
            runtime=RuntimeOptions(compile_stages=compiled),  # type: ignore[arg-type]  # checked there
        )


def _write_plan(plan: Any, args: argparse.Namespace) -> None:
    from pipecut.report.render import render

    if args.out:
        plan.to_json(args.out)
        log.info("wrote %s", args.out)
    for path in (args.html, args.dot):
        if path:
            render(plan, path, **({"title": f"pipecut plan of {args.factory}"} if path == args.html else {}))
            log.info("wrote %s", path)


def summary_data(plan: Plan) -> dict[str, Any]:
    """The summary table as JSON data (``pipecut show --json``)."""
    return {
        "schedule": plan.schedule.value,
        "microbatches": plan.microbatches,
        "batch_size": plan.batch_size,
        "stages_per_rank": plan.stages_per_rank,
        "stages": [
            {"index": s.index, "device": s.device, "nodes": len(s.nodes),
             "param_bytes": s.param_bytes, "forward_ms": s.forward_ms,
             "backward_ms": s.backward_ms, "comm_ms": s.comm_ms, "time_ms": s.time_ms,
             "peak_memory_bytes": s.peak_memory_bytes, "send_bytes": s.send_bytes,
             "recv_bytes": s.recv_bytes, "recompute": s.recompute.value}
            for s in plan.stages
        ],
        "predicted": dataclasses.asdict(plan.predicted),
        "solver": dataclasses.asdict(plan.solver),
        "data_parallel": None if plan.data_parallel is None else {
            "kind": plan.data_parallel.resolved_kind.value,
            "replicas": plan.data_parallel.resolved_replicas},
        "replica_candidates": [
            {"replicas": c.replicas, "stages": c.stages, "per_stage": list(c.per_stage),
             "step_ms": c.step_ms, "layout": c.layout.value if c.layout else None, "note": c.note,
             "tensor_parallel": c.tensor_parallel}
            for c in plan.replica_candidates
        ],
        "cluster": None if plan.cluster is None else plan.cluster.spec,
        "placement": None if plan.placement is None else {
            "layout": plan.placement.layout.value, "replicas": plan.placement.replicas,
            "stages": plan.placement.stages, "tensor_parallel": plan.placement.tensor_parallel,
            "tensor_groups": [list(g) for g in plan.placement.tensor_groups()],
            "gpus": [{"replica": r, "stage": s} for r, s in plan.placement.grid()]},
        "run": None if plan.run is None else dataclasses.asdict(plan.run),
    }


def cmd_show(args: argparse.Namespace) -> int:
    plan = _load(args.plan)
    if args.json:
        _print_json(summary_data(plan))
    else:
        print(summary(plan))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from pipecut.report.diff import diff_plans, format_diff

    a, b = _load(args.a), _load(args.b)
    diff = diff_plans(a, b)
    if args.json:
        _print_json({"a": args.a, "b": args.b, "moved_nodes": diff.moved_nodes,
                     **dataclasses.asdict(diff)})
    else:
        print(format_diff(diff, names=(args.a, args.b)))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from pipecut.report.render import render

    out = args.output or str(Path(args.plan).with_suffix(".html"))
    check_output(out, "-o", _RENDERED)
    plan = _load(args.plan)
    render(plan, out, timeline=args.timeline, title=args.title)
    print(out)
    return 0


def _profile_names() -> list[str]:
    from pipecut.profile.devices import device_profiles

    return [p.name for p in device_profiles()]


def _solver_names() -> list[str]:
    from pipecut.options import IlpSolver

    return [s.value for s in IlpSolver]


# --- parser -----------------------------------------------------------------------------------
_Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _verbosity(default: object) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=default,
                        help="more log output (-v info, -vv debug); ranks other than 0 stay quieter")
    common.add_argument("-q", "--quiet", action="store_const", const=-1, dest="verbose",
                        default=default, help="errors only, no progress bar")
    return common


def build_parser() -> argparse.ArgumentParser:
    # -v/-q work before and after the command; SUPPRESS keeps a subcommand's default from
    # overwriting what was given before it.
    common = _verbosity(argparse.SUPPRESS)
    from pipecut import __version__

    parser = argparse.ArgumentParser(
        prog="pipecut", parents=[_verbosity(0)],
        description="Partition a PyTorch model into pipeline stages, and look at the plan.",
    )
    parser.add_argument("--version", action="version", version=f"pipecut {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_plan(sub, common)
    _add_show(sub, common)
    _add_diff(sub, common)
    _add_render(sub, common)
    return parser


def _add_plan(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "plan", parents=[common], help="capture, profile and partition a model",
        description="Plan a model. FACTORY returns (model, example_inputs, loss_fn, target); "
        f"shipped examples: {', '.join(SHIPPED)}.",
    )
    _plan_shape_arguments(p)
    _plan_cost_arguments(p)
    _plan_output_arguments(p)
    p.set_defaults(run=cmd_plan)


def _plan_shape_arguments(p: argparse.ArgumentParser) -> None:
    """What to plan: the model, the stages, the microbatches, the schedule, the split."""
    p.add_argument("factory", metavar="MODULE:FACTORY",
                   help="dotted module or .py path, a colon, and the factory function's name")
    p.add_argument("--devices", "-k", type=_positive, default=2, metavar="K",
                   help="number of pipeline stages (default 2)")
    p.add_argument("--microbatches", "-m", type=_count_or_auto, default=4, metavar="M",
                   help="microbatches per step; must divide the batch size (default 4); 'auto': "
                        "the planner picks M by predicted step time")
    p.add_argument("--schedule", "-s", choices=[s.value for s in ScheduleKind] + ["auto"], default="1f1b",
                   help="'auto': the planner picks the schedule by predicted step time")
    p.add_argument("--split", type=parse_split, default=None, metavar="SPLIT",
                   help="pin the split: modules where stages 1.. begin ('blocks.2,blocks.4') or "
                        "modules per stage ('emb,blocks.0|blocks.1,head'); the summary shows "
                        "what it costs against pipecut's own split")
    p.add_argument("--memory-limit", type=parse_bytes, default=None, metavar="SIZE",
                   help="memory capacity of every device, e.g. 2GiB (default: unlimited, or the "
                   "device profile's)")
    p.add_argument("--tensor-parallel", type=_auto_or_positive, default="auto", metavar="auto|T",
                   help="with --cluster: T GPUs of a node split each stage's layers (Megatron's column/row "
                        "pairing, sequence parallel); 'auto' (default) weighs every T that divides the GPUs "
                        "per node and the attention heads, 1 plans without it")
    p.add_argument("--data-parallel", choices=["auto"], default=None,
                   help="choose D replicas x K stages for the --devices N by predicted step "
                        "(gradient all-reduce included); the plan is one replica's K stages")
    p.add_argument("--stages-per-rank", type=_positive, default=1, metavar="V",
                   help="virtual stages per device, with --schedule interleaved-1f1b (default 1; zbv always runs 2)")


def _plan_cost_arguments(p: argparse.ArgumentParser) -> None:
    """Where the costs come from: the device, the cluster, the link, the solver."""
    p.add_argument("--device-profile", metavar="NAME", default=None,
                   help="plan for this GPU instead of profiling here: times estimated from FLOPs "
                   "and bytes, memory and link from its datasheet; one of "
                   f"{', '.join(_profile_names())}")
    p.add_argument("--cluster", metavar="NxGxPROFILE", default=None,
                   help="plan a training run for N nodes of G GPUs of a device profile, e.g. "
                   "8x8xH100-SXM: costs estimated, D replicas x K stages and their placement on "
                   "nodes chosen by predicted step (FSDP, bf16 with fp32 AdamW); see docs/clusters.md")
    p.add_argument("--framework", choices=[f.value for f in FrameworkKind], default=None,
                   help="with --cluster: the training framework whose run is priced (MeasureOptions.framework; "
                   "default: pipecut's own runtime); see compiler/frameworks.json")
    p.add_argument("--recompute", choices=["auto", "none", "selective", "full"], default="auto",
                   help="how much a stage may recompute in backward (PartitionOptions.recompute): "
                   "with --cluster the run's activation checkpointing ('auto': selective); else "
                   "'full' lets the partitioner recompute blocks or whole stages where memory "
                   "needs it ('auto': where a device has a memory capacity)")
    p.add_argument("--measure-on", metavar="DEVICE", default=None,
                   help="time the nodes on this device, one node's weights there at a time "
                   "(default: cuda when CUDA is available, else where the factory's inputs are)")
    p.add_argument("--link", type=parse_link, default=None, metavar="BW[,LAT_MS]",
                   help="link between stages: bandwidth in bytes/s and latency in ms, e.g. "
                   "25GB,0.01 (default: 2GB,0.05, or the device profile's)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip timing the first split's stages whole and re-partitioning")
    p.add_argument("--no-chunk-heavy", dest="chunk_heavy", action="store_false",
                   help="never compute a node heavier than a stage's share (an LM head) in row "
                   "pieces spread over stages")
    p.add_argument("--solver", choices=_solver_names(), default="highs",
                   help="ILP solver, when memory limits or device speeds need the ILP")
    p.add_argument("--compile-stages", choices=["off", "on", "auto"], default="off",
                   help="price the stages as torch.compile runs them (on), or both ways keeping the "
                   "cheaper with the compile time (auto); the calibration compiles them here")


def _plan_output_arguments(p: argparse.ArgumentParser) -> None:
    """The factory's own arguments and the files to write."""
    p.add_argument("--batch-size", type=_positive, default=None,
                   help="passed to the factory as batch_size=")
    p.add_argument("--seed", type=int, default=None, help="passed to the factory as seed=")
    p.add_argument("--out", "-o", metavar="PLAN.json", help="write the plan as JSON")
    p.add_argument("--html", metavar="PLAN.html", help="write the HTML report")
    p.add_argument("--dot", metavar="PLAN.dot", help="write the stage graph as Graphviz DOT")


def _add_show(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("show", parents=[common], help="print a plan's summary table")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--json", action="store_true", help="the summary as JSON")
    p.set_defaults(run=cmd_show)


def _add_diff(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("diff", parents=[common],
                       help="which nodes moved between stages, and the predicted effect")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.add_argument("--json", action="store_true", help="the diff as JSON")
    p.set_defaults(run=cmd_diff)


def _add_render(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("render", parents=[common],
                       help="write a plan as self-contained HTML (or DOT for a .dot output)")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--timeline", metavar="TRACE.json",
                   help="a measured Chrome trace to draw under the predicted schedule")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="output path, .html or .dot (default: the plan's path with .html)")
    p.add_argument("--title", help="page title")
    p.set_defaults(run=cmd_render)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure(args.verbose, logs.env_rank())
    try:
        return int(args.run(args))
    except PipecutError as e:
        print(f"pipecut {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `pipecut show plan.json | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
