"""Recompute benchmark: memory traded for time, single blocks against whole stages.

    .venv/bin/python benchmarks/recompute.py [--model gpt] [--fractions 1,0.9,0.8,0.7,0.6,0.5] [--steps 3]

K = 2 forked CPU ranks, one thread each, 1F1B, M = 8. The model is planned once without a
memory limit; then, for each fraction f, with every device's capacity set to f times the
largest stage peak of that plan (parameters, gradients, AdamW state and in-flight activations,
as the plan counts them). For each cap the planner chooses, per stage, no recompute, some blocks
(``Recompute.SELECTIVE``) or the whole stage. Reported per cap: that choice (recomputed nodes /
stage nodes), the plan's largest predicted stage peak, the activation peak measured by the
runtime's saved-tensor meter beside the plan's predicted activation share (both the largest
over stages), and the median step; then the same split with each recomputing stage recomputing
whole ("whole"): its step and measured activation peak. Not a test: times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from benchmarks.runtime import MODELS, with_recompute
from pipecut.passes.costs.stages import state_bytes
from tests.harness import run_ranks

MICROBATCHES, WORLD = 8, 2
MIB = 1 << 20


def _step_ms(pipe: Any, inputs: Any, target: Any, steps: int) -> float:
    times = []
    for i in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        pipe.step(inputs, target)
        pipe.module.zero_grad()
        if i:  # the first is a warm-up
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _rank(rank: int, world: int, name: str, fractions: list[float], steps: int) -> list[dict[str, Any]]:
    model, inputs, loss_fn, target = MODELS[name]()
    kw = dict(example_inputs=inputs, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
              schedule="1f1b", timeout=300, calibration_steps=0)
    free = pipecut.compile(model, devices=world, **kw).plan
    top = max(s.peak_memory_bytes for s in free.stages)
    rows = []
    for f in fractions:
        devices = [pipecut.DeviceSpec(name=f"cpu{r}", memory_bytes=int(top * f)) for r in range(world)]
        try:
            pipe = pipecut.compile(model, devices=devices, **kw)
        except (pipecut.PartitionError, pipecut.PipelineRuntimeError) as e:  # rank 1 hears of it from rank 0
            rows.append({"fraction": f, "cap_mib": top * f / MIB, "error": str(e).split("PartitionError: ")[-1].split(";")[0]})
            continue
        plan = pipe.plan
        row: dict[str, Any] = {
            "fraction": f, "cap_mib": top * f / MIB,
            "choice": [f"{s.recompute.value} {len(s.recomputed) or ''}/{len(s.nodes)}".replace(" /", "/")
                       for s in plan.stages],
            "predicted_peak_mib": max(s.peak_memory_bytes for s in plan.stages) / MIB,
            "predicted_activation_mib": max(s.peak_memory_bytes - state_bytes(s.param_bytes) for s in plan.stages) / MIB,
            "predicted_step_ms": plan.predicted.step_ms,
            "ms": _step_ms(pipe, inputs, target, steps),
            "activation_mib": pipe.peak_activation_bytes / MIB,
        }
        kinds = [pipecut.Recompute.FULL if s.recompute is not pipecut.Recompute.NONE else s.recompute
                 for s in plan.stages]
        if kinds != [s.recompute for s in plan.stages]:
            whole = pipecut.compile(model, devices=world, plan=with_recompute(plan, kinds), **kw)
            row |= {"whole_ms": _step_ms(whole, inputs, target, steps),
                    "whole_activation_mib": whole.peak_activation_bytes / MIB,
                    "whole_predicted_step_ms": whole.plan.predicted.step_ms}
        rows.append(row)
    return rows


def run(name: str, fractions: list[float], steps: int) -> list[dict[str, Any]]:
    per_rank = run_ranks(_rank, WORLD, name, fractions, steps, timeout=1800, collective_timeout=600)
    rows = per_rank[0]
    for i, row in enumerate(rows):  # the largest over the stages (one per rank)
        for key in ("activation_mib", "whole_activation_mib"):
            if key in row:
                row[key] = max(r[i][key] for r in per_rank)
        for key in ("ms", "whole_ms"):
            if key in row:
                row[key] = max(r[i][key] for r in per_rank)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("cap", "MiB", "choice per stage", "pred peak", "pred act", "meas act", "pred ms", "step ms",
            "whole ms", "whole act")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        if "error" in r:
            print(f"{r['fraction']:.2f} | {r['cap_mib']:.1f} | {r['error']}")
            continue
        whole = (f"{r['whole_ms']:.0f} | {r['whole_activation_mib']:.1f}" if "whole_ms" in r else "- | -")
        print(f"{r['fraction']:.2f} | {r['cap_mib']:.1f} | {', '.join(r['choice'])} | {r['predicted_peak_mib']:.1f} | "
              f"{r['predicted_activation_mib']:.1f} | {r['activation_mib']:.1f} | {r['predicted_step_ms']:.0f} | "
              f"{r['ms']:.0f} | {whole}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt", choices=sorted(MODELS))
    ap.add_argument("--fractions", default="1,0.9,0.8,0.7,0.6,0.5")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).with_name("recompute.json")))
    args = ap.parse_args()
    rows = run(args.model, [float(f) for f in args.fractions.split(",")], args.steps)
    print_table(rows)
    Path(args.out).write_text(json.dumps({"model": args.model, "microbatches": MICROBATCHES, "ranks": WORLD,
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
