"""Activation memory with recompute, measured against what compile's planner prices, under
1F1B and zero-bubble.

    .venv/bin/python benchmarks/recompute_memory.py [--out benchmarks/recompute_memory.json]

The example GPT (``examples/gpt.py::build``), K = 2 CPU ranks on gloo, 4 microbatches, one split
for every row (the plain plan's), each stage recomputing nothing, its first block (selective) or
all of it (full). Per rank:

- **measured**: the stage's peak of what it keeps between forward and backward
  (``pipe.peak_activation_bytes``: autograd's saved tensors, the inputs a recomputing segment
  holds, and tensors alive only because their send has not completed), and of that the sends;
- **priced**: compile's planner on the same stages (``build_stages``: one microbatch's kept bytes
  × the microbatches the schedule holds at once, ``inflight_microbatches``).

Counted bytes, not timings: the same on every run. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from examples import gpt
from pipecut.cluster import Link
from pipecut.core.kinds import ScheduleKind
from pipecut.ir import Plan
from pipecut.passes.costs.stages import build_stages, inflight_microbatches
from pipecut.passes.partition.chain import liveness
from tests.harness import run_ranks
from tests.reference import COUNTED, recompute_blocks, recompute_whole

M = 4
RECOMPUTE = {"none": lambda p: p, "selective": lambda p: recompute_blocks(p, "blocks", 1), "full": recompute_whole}


def _measure(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, inputs, loss_fn, target = gpt.build()
    split = pipecut.plan(model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M, schedule="1f1b",
                         measure=COUNTED)
    out = {}
    for schedule in ("1f1b", "zero-bubble"):
        for level, how in RECOMPUTE.items():
            model, inputs, loss_fn, target = gpt.build()
            plan = how(dataclasses.replace(split, schedule=ScheduleKind(schedule)))
            pipe = pipecut.compile(model, inputs, world, loss_fn=loss_fn, target=target, plan=plan, measure=COUNTED,
                                   runtime=pipecut.RuntimeOptions(timeout=120))
            pipe.step(inputs, target)
            out[f"{schedule}/{level}"] = {
                "plan": pipe.plan.to_json(), "measured": pipe.peak_activation_bytes,
                "sending": sum(w.meter.peak_sending for w in pipe.workers.values())}
    return out


def priced(plan: Plan, rank: int) -> int:
    """Compile's planner's activation bytes for ``rank``'s stage of ``plan`` at its peak."""
    live = liveness(plan.nodes)
    bounds = [live.index[s.nodes[0]] for s in plan.stages] + [len(live.units)]
    facts = build_stages(plan.nodes, live, bounds, devices=plan.devices, link=Link(bandwidth_bytes_per_ms=1e6),
                         schedule=plan.schedule, microbatches=plan.microbatches,
                         recompute=[s.recompute for s in plan.stages], recomputed=[s.recomputed for s in plan.stages])
    return facts.stages[rank].activation_bytes * inflight_microbatches(plan.schedule, plan.num_stages,
                                                                       plan.microbatches)[rank]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).with_name("recompute_memory.json")))
    args = ap.parse_args()
    ranks = run_ranks(_measure, 2, timeout=1200)
    rows = []
    for key in ranks[0]:
        schedule, level = key.split("/")
        for rank, got in enumerate(ranks):
            plan = Plan.from_json(got[key]["plan"])
            price, measured, sending = priced(plan, rank), got[key]["measured"], got[key]["sending"]
            rows.append({"schedule": schedule, "recompute": level, "rank": rank,
                         "in_flight": inflight_microbatches(plan.schedule, plan.num_stages, M)[rank],
                         "measured_bytes": measured, "sending_bytes": sending, "priced_bytes": price,
                         "kept_over_priced": round((measured - sending) / price, 3) if price else None})
    print(f"{'schedule':12} {'recompute':9} {'rank':>4} {'in flight':>9} {'measured KiB':>12} {'of it sends':>11} "
          f"{'priced KiB':>10} {'kept / priced':>13}")
    for r in rows:
        ratio = "-" if r["kept_over_priced"] is None else f"{r['kept_over_priced']:.3f}"
        print(f"{r['schedule']:12} {r['recompute']:9} {r['rank']:4} {r['in_flight']:9} {r['measured_bytes'] / 1024:12.1f} "
              f"{r['sending_bytes'] / 1024:11.1f} {r['priced_bytes'] / 1024:10.1f} {ratio:>13}")
    Path(args.out).write_text(json.dumps({"command": sys.argv, "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
