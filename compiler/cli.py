"""The ``pipecut`` command (also ``python -m pipecut``): plan, show, diff and render plans.

    pipecut plan examples.gpt:build --devices 4 --microbatches 8 --schedule 1f1b \\
        --memory-limit 2GiB --out plan.json --html plan.html
    pipecut show plan.json
    pipecut diff a.json b.json
    pipecut render plan.json --timeline trace.json -o plan.html     # or -o plan.dot

``MODULE:FACTORY`` names a function returning ``(model, example_inputs, loss_fn, target)``;
see :mod:`pipecut.factory`. Exit status: 0 on success, 1 when pipecut refuses the input (the
message says why and how to fix it), 2 for bad command-line usage.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from pipecut import logs
from pipecut.errors import PipecutError
from pipecut.factory import SHIPPED, call_factory, load_factory
from pipecut.plan import DeviceSpec, Plan, ScheduleKind

__all__ = ["build_parser", "cmd_diff", "cmd_plan", "cmd_render", "cmd_show", "main", "parse_bytes"]

log = logging.getLogger("pipecut.cli")

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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _load(path: str) -> Plan:
    plan = Plan.from_json(Path(path))
    log.info("loaded %s: %d stages, %d nodes", path, plan.num_stages, len(plan.nodes))
    return plan


# --- commands ---------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    import pipecut
    from pipecut.planner import as_devices
    from pipecut.render import render

    factory = load_factory(args.factory)
    example = call_factory(factory, batch_size=args.batch_size, seed=args.seed, spec=args.factory)
    devices = [DeviceSpec(name=d.name, memory_bytes=args.memory_limit, speed=d.speed)
               for d in as_devices(args.devices)]
    log.info("planning %s on %d devices, %d microbatches, %s", args.factory, len(devices),
             args.microbatches, args.schedule)
    rank = logs.env_rank()
    with logs.progress("profiling", enabled=logs.show_progress(rank, verbosity=args.verbose)) as bar:
        plan = pipecut.plan(
            example.model, example.inputs, devices, loss_fn=example.loss_fn, target=example.target,
            microbatches=args.microbatches, schedule=args.schedule, progress=bar,
        )
    if args.out:
        plan.to_json(args.out)
        log.info("wrote %s", args.out)
    if args.html:
        render(plan, args.html, title=f"pipecut plan of {args.factory}")
        log.info("wrote %s", args.html)
    if args.dot:
        render(plan, args.dot)
        log.info("wrote %s", args.dot)
    print(plan.summary())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    plan = _load(args.plan)
    print(plan.summary())
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from pipecut.diff import diff_plans, format_diff

    a, b = _load(args.a), _load(args.b)
    print(format_diff(diff_plans(a, b), names=(args.a, args.b)))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from pipecut.render import render

    plan = _load(args.plan)
    out = args.output or str(Path(args.plan).with_suffix(".html"))
    render(plan, out, timeline=args.timeline, title=args.title)
    print(out)
    return 0


# --- parser -----------------------------------------------------------------------------------
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
    parser = argparse.ArgumentParser(
        prog="pipecut", parents=[_verbosity(0)],
        description="Partition a PyTorch model into pipeline stages, and look at the plan.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "plan", parents=[common], help="capture, profile and partition a model",
        description="Plan a model. FACTORY returns (model, example_inputs, loss_fn, target); "
        f"shipped examples: {', '.join(SHIPPED)}.",
    )
    p.add_argument("factory", metavar="MODULE:FACTORY",
                   help="dotted module or .py path, a colon, and the factory function's name")
    p.add_argument("--devices", "-k", type=_positive, default=2, metavar="K",
                   help="number of pipeline stages (default 2)")
    p.add_argument("--microbatches", "-m", type=_positive, default=4, metavar="M",
                   help="microbatches per step; must divide the batch size (default 4)")
    p.add_argument("--schedule", "-s", choices=[s.value for s in ScheduleKind], default="1f1b")
    p.add_argument("--memory-limit", type=parse_bytes, default=None, metavar="SIZE",
                   help="memory capacity of every device, e.g. 2GiB (default: unlimited)")
    p.add_argument("--batch-size", type=_positive, default=None,
                   help="passed to the factory as batch_size=")
    p.add_argument("--seed", type=int, default=None, help="passed to the factory as seed=")
    p.add_argument("--out", "-o", metavar="PLAN.json", help="write the plan as JSON")
    p.add_argument("--html", metavar="PLAN.html", help="write the HTML report")
    p.add_argument("--dot", metavar="PLAN.dot", help="write the stage graph as Graphviz DOT")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("show", parents=[common], help="print a plan's summary table")
    p.add_argument("plan", metavar="PLAN.json")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("diff", parents=[common],
                       help="which nodes moved between stages, and the predicted effect")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.set_defaults(run=cmd_diff)

    p = sub.add_parser("render", parents=[common],
                       help="write a plan as self-contained HTML (or DOT for a .dot output)")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--timeline", metavar="TRACE.json",
                   help="a measured Chrome trace to draw under the predicted schedule")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="output path, .html or .dot (default: the plan's path with .html)")
    p.add_argument("--title", help="page title")
    p.set_defaults(run=cmd_render)
    return parser


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
