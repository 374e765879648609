"""Benchmark: HiGHS against CBC on the ILP rows of ``benchmarks/partition.py``.

    .venv/bin/python benchmarks/ilp_solvers.py [--quick] [--only PREFIX] [--out ilp_solvers.json]

The same problems as the partition benchmark's ILP column: every model's cost table (profiled
once), K = 2, 4, 8 without a memory limit and K = 4 with the limit halfway between the least
memory with and without recompute; 1F1B, 8 microbatches. Each problem goes through
``partition_ilp`` (exact DP, then the ILP over the same cut positions, warm-started from the
DP's split) once per solver, with a 30 s limit. *ms* is the whole ``partition_ilp`` call
(the DP part is the same for both); *proved* says whether the solver proved optimality; the
two answers' slowest stage must agree when both proved it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.partition import MICROBATCHES, SCHEDULE, _examples, _hf, cost_table, parse_args
from benchmarks.synthetic import transformer_costs
from pipecut.core.kinds import NodeOp
from pipecut.ir import DeviceSpec, NodeCost
from pipecut.options import IlpSolver
from pipecut.passes.partition.memory_floor import min_peak_memory
from pipecut.passes.partition.memory_partition import partition_ilp
from pipecut.passes.partition.problem import formulate
from pipecut.passes.partition.solve import DEFAULT_LINK


def problems(name: str, nodes: tuple[NodeCost, ...]) -> list[tuple[str, int, float | None]]:
    units = sum(1 for n in nodes if n.op not in (NodeOp.PLACEHOLDER, NodeOp.GET_ATTR))
    out: list[tuple[str, int, float | None]] = [(name, k, None) for k in (2, 4, 8) if units >= 2 * k]
    need = {}
    for rc in (False, True):
        form = formulate(nodes, devices=[DeviceSpec(name="d")] * 4, link=DEFAULT_LINK,
                         schedule=SCHEDULE, microbatches=MICROBATCHES, recompute=rc)
        need[rc] = min_peak_memory(form.problem)[0]
    if need[True] < 0.9 * need[False]:
        out.append((name, 4, (need[True] + need[False]) / 2))
    return out


def run(nodes: tuple[NodeCost, ...], k: int, memory: float | None) -> dict:
    specs = [DeviceSpec(name=f"d{i}", memory_bytes=None if memory is None else int(memory))
             for i in range(k)]
    form = formulate(nodes, devices=specs, link=DEFAULT_LINK, schedule=SCHEDULE,
                     microbatches=MICROBATCHES, recompute=memory is not None)
    row: dict = {"units": form.problem.units}
    for solver in IlpSolver:
        start = time.perf_counter()
        res = partition_ilp(form.problem, modules=form.modules, time_limit_s=30, solver=solver)
        row[solver.value] = {"ms": (time.perf_counter() - start) * 1e3, "proved": res.optimal,
                             "bottleneck_ms": res.evaluation.bottleneck_ms}
    h, c = row["highs"], row["cbc"]
    if h["proved"] and c["proved"]:
        assert abs(h["bottleneck_ms"] - c["bottleneck_ms"]) <= 1e-6 * c["bottleneck_ms"], row
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | units | K | memory limit | HiGHS ms | proved | CBC ms | proved | "
             "slowest stage ms (HiGHS / CBC) |", "|---|---:|---:|---|---:|---|---:|---|---|"]
    for r in rows:
        h, c = r["highs"], r["cbc"]
        mem = "none" if r["memory"] is None else f"{r['memory'] / 2**20:.1f} MiB"
        lines.append(
            f"| {r['model']} | {r['units']} | {r['k']} | {mem} | {h['ms']:.0f} | "
            f"{'yes' if h['proved'] else 'no'} | {c['ms']:.0f} | {'yes' if c['proved'] else 'no'} "
            f"| {h['bottleneck_ms']:.2f} / {c['bottleneck_ms']:.2f} |"
        )
    total = {s: sum(r[s]["ms"] for r in rows) for s in ("highs", "cbc")}
    lines.append(f"| **total** | | | | **{total['highs']:.0f}** | | **{total['cbc']:.0f}** | | |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    builders = {**_examples(), **({} if args.quick else _hf())}
    tables = {}
    for name, build in builders.items():
        if name.startswith(args.only):
            tables[name] = cost_table(build, args.repeats)[0]
            print(f"profiled {name}: {len(tables[name])} nodes", file=sys.stderr)
    if "synthetic/transformer-48L".startswith(args.only):
        tables["synthetic/transformer-48L"] = transformer_costs(48)
    rows = []
    for name, nodes in tables.items():
        for model, k, memory in problems(name, nodes):
            rows.append({"model": model, "k": k, "memory": memory, **run(nodes, k, memory)})
            print(f"done {model} K={k} memory={memory}", file=sys.stderr)
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
