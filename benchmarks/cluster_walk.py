"""Walk ``cluster`` through the cluster planner, as issue 44 asks: where the cluster and its
figures are handed, from ``plan_cluster`` down.

    .venv/bin/python benchmarks/cluster_walk.py [--out benchmarks/cluster_walk.json]

Every call between two of pipecut's modules that hands down the cluster, one of its links, its
device profile, its per-op model, or a record holding one, traced with ``sys.setprofile`` on one
small plan (a two-layer transformers Llama on 2 x 4 H100). Printed: the planner's own steps in
time (its calls into other modules, consecutive calls to one module merged), then every
caller -> callee edge, marked UP where the callee sits on a higher floor than its caller (the
front above the passes above the data; inside the cluster package, the order of its docstring).
It runs on older trees too (``pipecut.planning.clusters``), for a before-and-after.
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipecut.cluster import Cluster, Link
from pipecut.profile.devices import DeviceProfile
from pipecut.profile.hardware import HardwareModel

try:
    from pipecut.planning.cluster.plan import plan_cluster
except ImportError:  # a tree before the cluster package
    from pipecut.planning.clusters import plan_cluster  # type: ignore[no-redef]
from tests.unit.tiny import tiny_llama

KINDS = (Cluster, Link, DeviceProfile, HardwareModel)

def holds(v: object) -> bool:
    if isinstance(v, KINDS):
        return True
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return any(isinstance(getattr(v, f.name, None), KINDS) for f in dataclasses.fields(v))
    return False

ORDER = ["pipecut.planning.cluster.plan", "pipecut.planning.clusters", "pipecut.planning.cluster.figures",
         "pipecut.planning.cluster.tables", "pipecut.planning.tensor_parallel", "pipecut.planning.cluster.choose",
         "pipecut.planning.cluster.run", "pipecut.passes.parallel.training", "pipecut.planning.cluster.stage",
         "pipecut.planning.cluster.schedule", "pipecut.planning.cluster.foreign", "pipecut.passes.parallel.run_costs",
         "pipecut.passes.parallel.run_schedule", "pipecut.passes.parallel.foreign_runtime",
         "pipecut.planning.cluster.run_plan", "pipecut.planning.run_plan"]


def floor(m: str) -> int:
    """A module's floor: lower numbers sit higher."""
    if m in ORDER:
        return ORDER.index(m)
    if m.startswith(("pipecut.profile", "pipecut.planning", "pipecut.capture")):
        return 20
    if m.startswith("pipecut.passes"):
        return 30
    return 40  # data

ENTRY = ("pipecut.planning.cluster.plan", "pipecut.planning.clusters")


def walk() -> tuple[list[str], dict[tuple[str, str], int]]:
    """One small plan traced: the planner's own steps in time (consecutive calls to one module
    merged) and every caller -> callee edge that hands the cluster or its figures down, with
    its calls."""
    edges: dict[tuple[str, str], int] = {}
    top: list[str] = []

    def prof(frame, event, arg):  # type: ignore[no-untyped-def]
        if event != 'call':
            return
        mod = frame.f_globals.get('__name__', '')
        caller = frame.f_back.f_globals.get('__name__', '') if frame.f_back else ''
        if not mod.startswith('pipecut') or not caller.startswith('pipecut') or mod == caller or mod == 'pipecut.cluster':
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(holds(frame.f_locals.get(n)) for n in names if n != 'self'):
            edges[(caller, mod)] = edges.get((caller, mod), 0) + 1
            if caller in ENTRY and (not top or top[-1] != mod):
                top.append(mod)

    model, ids = tiny_llama()
    sys.setprofile(prof)
    try:
        plan_cluster(model, ids, "2x4xH100-SXM", microbatches=2)
    finally:
        sys.setprofile(None)
    return top, edges


def going_up(edges: dict[tuple[str, str], int]) -> list[tuple[str, str]]:
    """The edges whose callee sits on a higher floor than its caller."""
    return [(a, b) for a, b in edges if floor(b) < floor(a)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).with_name("cluster_walk.json")))
    args = ap.parse_args()
    top, edges = walk()
    print("the planner's own steps, in time (consecutive calls to one module merged):")
    print("  " + " -> ".join(m.removeprefix("pipecut.") for m in top))
    print(f"  {len(top)} entries into {len(set(top))} modules")
    rooms = sorted({m for e in edges for m in e})
    up = going_up(edges)
    print(f"{len(rooms)} modules, {len(edges)} caller->callee edges, {len(up)} going up a floor")
    for (a, b), n in sorted(edges.items(), key=lambda e: (floor(e[0][0]), floor(e[0][1]))):
        print(f"  {'UP ' if (a, b) in up else '   '}{a.removeprefix('pipecut.')} -> {b.removeprefix('pipecut.')} ({n} calls)")
    Path(args.out).write_text(json.dumps({"command": sys.argv, "steps": top, "up": len(up),
                                          "edges": [{"caller": a, "callee": b, "calls": n} for (a, b), n in edges.items()]},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
