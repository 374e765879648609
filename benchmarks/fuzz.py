"""A differential fuzzing campaign: pipecut against the plain model, on drawn configurations.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fuzz.py --seeds 1-20 --examples 40 \\
        --budget-min 45 --json benchmarks/fuzz.json

For each seed, draws ``--draw`` configurations with hypothesis (tests/fuzz_config.py:
hand-written and transformers models, K, M, schedule, stages per rank, plan source, recompute,
autocast, parameter and default dtype, a parameter frozen after compile, loss reduction,
accumulation and no_sync, last batch, eval steps, data parallelism, automatic microbatches and
schedule), keeps the ``--examples`` that cover the most pairs of feature values not covered
by earlier seeds, runs them in rounds of ``--round`` on pools of forked ranks (tests/fuzz_pool.py) and
compares each with the plain model (tests/fuzz_check.py), until the seeds or ``--budget-min``
run out (the JSON is rewritten after every round, so a long run can be read while it goes).
Then each distinct failure (known bug or signature) is shrunk (our own greedy shrinking over
the configuration; see tests/fuzz_pool.py) and classified by its shrunk configuration: one of
the known open bugs (tests/fuzz_bugs.py) or new. A refusal (a PipecutError where the run meets
something new) is a pass. Prints tables of outcomes (overall, per model), the refusals, the
worst errors of the matches per precision (what the tolerances are measured against) and the
failures.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz_bugs import known
from tests.fuzz_check import precision
from tests.fuzz_config import PLANS, Config, draw, spread
from tests.fuzz_models import MODELS
from tests.fuzz_pool import Outcome, run_configs, shrink
from tests.fuzz_run import NO_SYNC

KINDS = ("match", "refused", "mismatch", "error", "hang")


def _seeds(text: str) -> list[int]:
    """``"3"``, ``"1-20"`` or ``"1,4,9"``."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=30, help="configurations run per seed")
    parser.add_argument("--draw", type=int, default=200,
                        help="configurations drawn per seed, of which the --examples covering the most pairs "
                             "of feature values run (hypothesis's draws from one seed cluster)")
    parser.add_argument("--seeds", type=_seeds, default=[0], help='"3", "1-20" or "1,4,9"')
    parser.add_argument("--seed", type=int, default=None, help="one seed (as --seeds N)")
    parser.add_argument("--budget-min", type=float, default=None, help="stop drawing after this many minutes")
    parser.add_argument("--round", type=int, default=12, help="configurations run between JSON updates")
    parser.add_argument("--models", default="", help="comma-separated models to draw from (default: all)")
    parser.add_argument("--plans", default=",".join(PLANS), help="comma-separated plan sources to draw")
    parser.add_argument("--job-timeout", type=float, default=90.0, help="seconds without progress: a hang")
    parser.add_argument("--shrink-budget", type=int, default=30, help="runs per failure while shrinking")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--skip-known", action="store_true",
                        help="leave out configurations that hit a known open bug (tests/fuzz_bugs.py)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--replay", action="append", default=[], metavar="CONFIG",
                        help='run (and shrink) these instead of drawing: "Config(model=..., ...)" as printed')
    args = parser.parse_args(argv)
    if args.seed is not None:
        args.seeds = [args.seed]
    start = time.perf_counter()
    outcomes = _run(args, start)
    failures = _report(outcomes, time.perf_counter() - start)
    groups = _shrunk(failures, args)
    _write(args, outcomes, groups, time.perf_counter() - start)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 1 if groups else 0


def _batches(args: argparse.Namespace) -> Any:
    """Lists of configurations to run, seed after seed, in rounds of ``--round``."""
    if args.replay:
        yield [eval(text, {"Config": Config}) for text in args.replay]  # our own printout
        return
    kw: dict[str, Any] = {"no_sync": NO_SYNC, "plans": tuple(args.plans.split(","))}
    if args.models:
        kw["models"] = tuple(args.models.split(","))
        assert set(kw["models"]) <= set(MODELS), sorted(MODELS)
    seen: list[Config] = []
    for seed in args.seeds:
        drawn = [c for c in draw(max(args.draw, args.examples), seed, **kw)
                 if c not in seen and not (args.skip_known and known(c))]
        fresh = spread(drawn, args.examples, seen)
        seen += fresh
        print(f"seed {seed}: {len(fresh)} new configurations", flush=True)
        for i in range(0, len(fresh), args.round):
            yield fresh[i : i + args.round]


def _run(args: argparse.Namespace, start: float) -> list[Outcome]:
    outcomes: list[Outcome] = []

    def show(o: Outcome) -> None:
        print({"match": ".", "refused": "r", "mismatch": "M", "error": "E", "hang": "H"}[o.kind], end="", flush=True)

    for configs in _batches(args):
        if args.budget_min is not None and time.perf_counter() - start > 60 * args.budget_min:
            print(f"\ntime budget of {args.budget_min} min spent", flush=True)
            break
        outcomes += run_configs(configs, args.job_timeout, progress=show)
        print(f" [{len(outcomes)} in {time.perf_counter() - start:.0f} s]", flush=True)
        _write(args, outcomes, [], time.perf_counter() - start)
    return outcomes


def _report(outcomes: list[Outcome], seconds: float) -> dict[tuple[str, ...], list[Outcome]]:
    """Print the tables; the failures grouped by (known bug or "new", signature[, model])."""
    counts = Counter(o.kind for o in outcomes)
    print(f"\nran {len(outcomes)} configurations in {seconds:.0f} s\n\n| outcome | configurations |\n|---|---|")
    for kind in KINDS:
        print(f"| {kind} | {counts.get(kind, 0)} |")
    print("\n| model | " + " | ".join(KINDS) + " |\n|---|" + "---|" * len(KINDS))
    per_model: dict[str, Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        per_model[o.config.model][o.kind] += 1
    for model in sorted(per_model):
        print(f"| {model} | " + " | ".join(str(per_model[model][k]) for k in KINDS) + " |")
    refusals = Counter(f"{o.at}: {re.sub(r'[0-9]+', 'N', o.detail)[:150]}" for o in outcomes if o.kind == "refused")
    print()
    for text, n in refusals.most_common():
        print(f"  refused x{n} at {text}")
    print("\nworst errors of the matches (loss relative, grad relative to the step's largest, weight absolute):")
    print("| precision | configurations | loss | grad | weight |\n|---|---|---|---|---|")
    for prec, row in sorted(_errors(outcomes).items()):
        print(f"| {prec} | {row['n']:.0f} | {row.get('loss', 0):.1e} | {row.get('grad', 0):.1e} | "
              f"{row.get('weight', 0):.1e} |")
    failures: dict[tuple[str, ...], list[Outcome]] = {}
    for o in outcomes:
        if o.failed:
            bug = known(o.config, o.ran)
            key = (bug[0], o.signature) if bug else ("new", o.signature, o.config.model)
            failures.setdefault(key, []).append(o)
    return failures


def _errors(outcomes: list[Outcome]) -> dict[str, dict[str, float]]:
    """Per precision: matched configurations and the worst of each error."""
    rows: dict[str, dict[str, float]] = defaultdict(lambda: {"n": 0})
    for o in outcomes:
        if o.kind == "match":
            row = rows[precision(o.config)]
            row["n"] += 1
            for name, value in o.errors:
                row[name] = max(row.get(name, 0.0), value)
    return dict(rows)


def _shrunk(failures: dict[tuple[str, ...], list[Outcome]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Shrink the simplest failure of each group; classify it by its shrunk configuration."""
    report = []
    for key, group in failures.items():
        first = min(group, key=lambda o: len(o.config.short()))
        print(f"\n=== {len(group)} x {' / '.join(key)}\n  drawn: {first.config.short()}\n  {first.detail.strip()[-1200:]}")
        shrunk, runs = (first, 0) if args.no_shrink else shrink(first, args.job_timeout, args.shrink_budget)
        bugs = known(shrunk.config, shrunk.ran)
        print(f"  shrunk ({runs} runs): {shrunk.config.short()}\n  known: {bugs or 'NEW'}\n"
              f"  {shrunk.detail.strip()[-1500:]}", flush=True)
        report.append({"group": list(key), "count": len(group), "known": bugs, "drawn": first.config.short(),
                       "shrunk": shrunk.config.short(), "kind": shrunk.kind, "error": shrunk.error,
                       "at": shrunk.at, "detail": shrunk.detail[-3000:],
                       "configs": [o.config.short() for o in group]})
    return report


def _write(args: argparse.Namespace, outcomes: list[Outcome], failures: list[dict[str, Any]],
           seconds: float) -> None:
    if args.json is None:
        return
    args.json.write_text(json.dumps({
        "command": " ".join(sys.argv), "seeds": args.seeds, "examples": args.examples, "seconds": round(seconds),
        "configurations": len(outcomes), "counts": dict(Counter(o.kind for o in outcomes)),
        "errors": _errors(outcomes), "failures": failures,
        "outcomes": [{"config": o.config.short(), "kind": o.kind, "error": o.error, "at": o.at,
                      "known": known(o.config, o.ran) if o.failed else [], "errors": dict(o.errors),
                      "ran": o.ran,
                      "detail": o.detail[-1500:]} for o in outcomes],
    }, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
