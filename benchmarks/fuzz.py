"""A differential fuzzing campaign: pipecut against the plain model, on drawn configurations.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fuzz.py --examples 200 --seed 1 [--json out.json]

Draws ``--examples`` configurations with hypothesis from ``--seed`` (tests/fuzz_config.py:
models, K, M, schedule, stages per rank, plan source, recompute, autocast, loss reduction,
accumulation and no_sync, last batch, eval steps, data parallelism), runs them on pools of
forked ranks (tests/fuzz_pool.py), compares each with the plain model (tests/fuzz_check.py),
then shrinks each distinct failure (our own greedy shrinking over the configuration; see
tests/fuzz_pool.py) and prints it with its shrunk configuration. A refusal (a PipecutError)
is a pass. Prints a table of outcomes; ``--json`` writes every outcome.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz_config import Config, draw
from tests.fuzz_pool import Outcome, run_configs, shrink
from tests.fuzz_run import NO_SYNC


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job-timeout", type=float, default=60.0, help="seconds without progress: a hang")
    parser.add_argument("--shrink-budget", type=int, default=40, help="runs per failure while shrinking")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--skip-open", action="store_true",
                        help="leave out configurations that hit a bug still open (OPEN_BUGS in tests/dist/test_fuzz.py)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--replay", action="append", default=[], metavar="CONFIG",
                        help='run (and shrink) these instead of drawing: "Config(model=..., ...)" as printed')
    args = parser.parse_args(argv)

    start = time.perf_counter()
    if args.replay:
        configs = [eval(text, {"Config": Config}) for text in args.replay]  # our own printout
    else:
        configs = draw(args.examples, args.seed, no_sync=NO_SYNC)
    if args.skip_open:
        from tests.dist.test_fuzz import OPEN_BUGS

        configs = [c for c in configs if not any(hits(c) for hits in OPEN_BUGS.values())]
    print(f"{len(configs)} distinct configurations (seed {args.seed}, no_sync drawn: {NO_SYNC})", flush=True)

    def show(o: Outcome) -> None:
        mark = {"match": ".", "refused": "r"}.get(o.kind, "F")
        print(mark, end="", flush=True)

    outcomes = run_configs(configs, args.job_timeout, progress=show)
    print(f"\nran {len(outcomes)} configurations in {time.perf_counter() - start:.0f} s")
    counts = Counter(o.kind for o in outcomes)
    print("| outcome | configurations |\n|---|---|")
    for kind in ("match", "refused", "mismatch", "error", "hang"):
        print(f"| {kind} | {counts.get(kind, 0)} |")
    refusals = Counter(re.sub(r"\d+", "N", o.detail)[:140] for o in outcomes if o.kind == "refused")
    for text, n in refusals.most_common():
        print(f"  refused x{n}: {text}")
    failures: dict[str, list[Outcome]] = {}
    for o in outcomes:
        if o.failed:
            failures.setdefault(o.signature, []).append(o)
    report = []
    for sig, group in failures.items():
        first = min(group, key=lambda o: len(o.config.short()))
        print(f"\n=== {len(group)} x {sig}\n  drawn: {first.config.short()}\n  {first.detail.strip()[-1200:]}")
        shrunk, runs = (first, 0) if args.no_shrink else shrink(first, args.job_timeout, args.shrink_budget)
        print(f"  shrunk ({runs} runs): {shrunk.config.short()}\n  {shrunk.detail.strip()[-1200:]}", flush=True)
        report.append({"signature": sig, "count": len(group), "drawn": first.config.short(),
                       "shrunk": shrunk.config.short(), "detail": shrunk.detail})
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "seed": args.seed, "examples": args.examples, "configurations": len(outcomes),
            "counts": dict(counts), "failures": report,
            "outcomes": [{"config": o.config.short(), "kind": o.kind, "detail": o.detail[-2000:]} for o in outcomes],
        }, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
