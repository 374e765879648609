"""Benchmark: writing and loading plan JSON (pydantic codec) for plans of 1,000 to 20,000 nodes.

    .venv/bin/python benchmarks/plan_io.py [--sizes 1000 10000] [--repeats 3] [--out plan_io.json]

Each plan is the DP partition (4 stages, 1F1B, 8 microbatches) of a synthetic transformer cost
table (``benchmarks.synthetic.transformer_costs``, 210 nodes per layer, shaped like a model that
``torch.export`` decomposed op by op). Times are the best of ``--repeats`` wall-clock runs on
this machine: *to_json* (plan → text), *write* (``to_json(path)``), *from_json text* (parse,
check and build from a string), *from_json file* (from a path), *from_dict* (from parsed data,
as after ``json.load``). Every load is checked to give back the same plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.synthetic import transformer_costs
from pipecut.core.kinds import ScheduleKind
from pipecut.ir import DeviceSpec, Plan
from pipecut.passes.partition.solve import partition_costs

NODES_PER_LAYER = 210


def synthetic_plan(nodes: int) -> Plan:
    layers = max(1, round((nodes - 8) / NODES_PER_LAYER))
    costs = transformer_costs(layers, nodes_per_layer=NODES_PER_LAYER)
    return partition_costs(costs, devices=[DeviceSpec(name=f"d{i}") for i in range(4)],
                           microbatches=8, batch_size=16, schedule=ScheduleKind.ONE_F_ONE_B,
                           fingerprint=f"synthetic-{layers}L", inputs=("tokens",))


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(nodes: int, repeats: int, folder: Path) -> dict[str, float | int]:
    plan = synthetic_plan(nodes)
    text = plan.to_json()
    path = folder / f"plan-{nodes}.json"
    plan.to_json(path)
    data = json.loads(text)
    for again in (Plan.from_json(text), Plan.from_json(path), Plan.from_dict(data)):
        assert again == plan, "a loaded plan differs from the written one"
    Plan.from_json(text)  # build pydantic's validator before timing
    return {
        "nodes": len(plan.nodes),
        "kib": len(text.encode()) // 1024,
        "to_json_ms": best_ms(plan.to_json, repeats),
        "write_ms": best_ms(lambda: plan.to_json(path), repeats),
        "from_json_text_ms": best_ms(lambda: Plan.from_json(text), repeats),
        "from_json_file_ms": best_ms(lambda: Plan.from_json(path), repeats),
        "from_dict_ms": best_ms(lambda: Plan.from_dict(data), repeats),
    }


def table(rows: list[dict[str, float | int]]) -> str:
    lines = ["| nodes | JSON KiB | to_json ms | write ms | from_json text ms | "
             "from_json file ms | from_dict ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['kib']} | {r['to_json_ms']:.0f} | {r['write_ms']:.0f} "
                     f"| {r['from_json_text_ms']:.0f} | {r['from_json_file_ms']:.0f} "
                     f"| {r['from_dict_ms']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 20000],
                    help="approximate node counts of the plans (default 1000 10000 20000)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; best is kept")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(n, args.repeats, Path(folder)) for n in args.sizes]
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
