"""The split proven against the clock: pipecut's chosen split among every block-boundary split.

    .venv/bin/python benchmarks/oracle.py [--models gpt,hf_gpt2,hf_llama,resnet] [--ranks 2] [--rounds 3]
        [--stages-per-rank 1] [--schedule 1f1b] [--stage-times]

For each model: compile once as a user would (pipecut's partitioner, 1F1B, batch 16 in 8
microbatches, calibrated on the running ranks); its plan is pipecut's split. Then build, from
that plan's cost table, the plan of every split at the boundaries of the model's trunk
(the children of its longest ModuleList/Sequential: transformer blocks, residual blocks) with
``split=`` — for K = 2 every boundary, for K > 2 every combination or a seeded sample of
``--max-splits``. K is ranks x ``--stages-per-rank``: 4 stages on 2 ranks under
``interleaved-1f1b`` or ``zbv`` time a 4-stage split on this 2-core machine without running
4 processes on 2 cores. All candidates run with pipecut's own runtime on forked CPU ranks (gloo, one
thread each), round-robin over several rounds so that the machine's drift hits every candidate
alike; each is scored by the median of its step times. Reports where pipecut's split ranks and
how far it is from the measured best. Prints a table and writes JSON. Not a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from benchmarks.runtime import MODELS
from pipecut.passes.partition.solve import partition_costs
from tests.harness import run_ranks

BATCH, MICROBATCHES = 16, 8


def trunk(model: torch.nn.Module) -> list[str]:
    """FQNs of the children of the model's longest ModuleList/Sequential (its repeated blocks)."""
    best: tuple[int, str] = (0, "")
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > best[0]:
            best = (len(m), name)
    prefix = f"{best[1]}." if best[1] else ""
    return [f"{prefix}{i}" for i in range(best[0])]


def candidate_splits(blocks: list[str], stages: int, most: int, seed: int = 0) -> list[tuple[str, ...]]:
    """Split points (modules where stages 1.. begin) at block boundaries."""
    combos = list(itertools.combinations(blocks[1:], stages - 1))
    if len(combos) > most:
        combos = random.Random(seed).sample(combos, most)
    return combos


def _measure(rank: int, world: int, name: str, plans: list[str], rounds: int, steps: int,
             stage_times: bool = False) -> tuple[list[list[float]], list[Any]]:
    model, inputs, loss_fn, target = MODELS[name]()
    pipes = [pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target,
        plan=pipecut.Plan.from_json(p), runtime=pipecut.RuntimeOptions(timeout=600),
    ) for p in plans]
    times: list[list[float]] = [[] for _ in pipes]
    for pipe in pipes:  # warm-up
        pipe.step(inputs, target)
    for _ in range(rounds):
        for i, pipe in enumerate(pipes):
            for _ in range(steps):
                torch.distributed.barrier()
                start = time.perf_counter()
                pipe.step(inputs, target)
                times[i].append((time.perf_counter() - start) * 1e3)
                for p in pipe.parameters():
                    p.grad = None
    stages: list[Any] = []
    if stage_times:  # each stage's (forward, backward) ms inside pipelined steps, as calibration times them
        from pipecut.profile.live import measure_stages

        stages = [list(measure_stages(pipe, inputs, target, steps=3).stages) for pipe in pipes]
    return times, stages


def _compiled(rank: int, world: int, name: str, schedule: str, per_rank: int) -> str:
    """The plan ``pipecut.compile`` ends with: planned, then calibrated on the running ranks."""
    model, inputs, loss_fn, target = MODELS[name]()
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target,
        microbatches=MICROBATCHES, schedule=schedule,
        scheduling=pipecut.ScheduleOptions(stages_per_rank=per_rank if per_rank > 1 else None),
        runtime=pipecut.RuntimeOptions(timeout=600),
    )
    return pipe.plan.to_json()


def run(name: str, ranks: int, rounds: int, steps: int, most: int, schedule: str = "1f1b",
        per_rank: int = 1, stage_times: bool = False) -> dict[str, Any]:
    model = MODELS[name]()[0]
    chosen = pipecut.Plan.from_json(run_ranks(_compiled, ranks, name, schedule, per_rank, timeout=1800,
                                              collective_timeout=900)[0])
    units = [n for n in chosen.nodes if n.op.value not in ("placeholder", "get_attr")]
    chosen_starts = tuple(units[[u.name for u in units].index(s.nodes[0])].module for s in chosen.stages[1:])
    splits = candidate_splits(trunk(model), chosen.num_stages, most)
    given = [
        partition_costs(
            chosen.nodes, devices=chosen.devices[: chosen.num_ranks], microbatches=MICROBATCHES,
            batch_size=BATCH, schedule=chosen.schedule, link=chosen.link,
            fingerprint=chosen.fingerprint, capture=chosen.capture, inputs=chosen.inputs,
            stages_per_rank=chosen.stages_per_rank,
            partition=pipecut.PartitionOptions(split=list(points)),
        )
        for points in splits
    ]
    # A block-boundary split identical to pipecut's is measured once, as pipecut's.
    keep = [i for i, p in enumerate(given) if [s.nodes for s in p.stages] != [s.nodes for s in chosen.stages]]
    splits, plans = [splits[i] for i in keep], [chosen] + [given[i] for i in keep]
    times, stages = run_ranks(_measure, ranks, name, [p.to_json() for p in plans], rounds, steps, stage_times,
                              timeout=3600, collective_timeout=900)[0]
    rows = [
        {"split": "pipecut: " + ", ".join(chosen_starts) if i == 0 else ", ".join(splits[i - 1]),
         "predicted_ms": p.predicted.step_ms, "ms": statistics.median(t), "samples": len(t),
         "stages_predicted_ms": [[s.forward_ms, s.backward_ms] for s in p.stages]}
        for i, (p, t) in enumerate(zip(plans, times))
    ]
    for r, measured in zip(rows, stages):
        r["stages_ms"] = measured
    best = min(r["ms"] for r in rows)
    order = sorted(range(len(rows)), key=lambda i: rows[i]["ms"])
    for r in rows:
        r["vs_best"] = r["ms"] / best - 1
    return {"model": name, "ranks": ranks, "stages": chosen.num_stages, "schedule": chosen.schedule.value,
            "candidates": len(rows) - 1, "rows": rows,
            "pipecut_split_is_a_block_boundary": len(keep) < len(given),
            "pipecut_rank": order.index(0) + 1, "pipecut_vs_best": rows[0]["vs_best"],
            "pipecut_notes": chosen.solver.detail}


def print_result(res: dict[str, Any]) -> None:
    print(f"\n{res['model']}  {res['stages']} stages on {res['ranks']} ranks, {res['schedule']}  "
          f"{res['candidates']} block-boundary splits; pipecut's "
          f"split ranks {res['pipecut_rank']} of {res['candidates'] + 1}, "
          f"{res['pipecut_vs_best']:+.1%} from the measured best")
    print(f"  pipecut's notes: {res.get('pipecut_notes', '')}")
    for r in sorted(res["rows"], key=lambda r: r["ms"]):
        print(f"  {r['split'][:70]:70} measured {r['ms']:8.1f} ms ({r['vs_best']:+6.1%})  "
              f"predicted {r['predicted_ms']:8.1f} ms", flush=True)
        if r.get("stages_ms"):
            pairs = zip(r["stages_ms"], r["stages_predicted_ms"])
            print("      stages fwd+bwd ms, measured / predicted: " + "  ".join(
                f"{sum(m):6.1f} / {sum(p):6.1f}" for m, p in pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,hf_gpt2,hf_llama,resnet")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per candidate and round")
    parser.add_argument("--max-splits", type=int, default=12, help="sample at most this many splits")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--stage-times", action="store_true",
                        help="also time every stage of every candidate inside pipelined steps (as live "
                             "calibration does), beside the stage times its plan predicts")
    parser.add_argument("--out", default=str(Path(__file__).with_name("oracle.json")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for name in args.models.split(","):
        res = run(name, args.ranks, args.rounds, args.steps, args.max_splits, args.schedule, args.stages_per_rank,
                  args.stage_times)
        print_result(res)
        results.append(res)
    Path(args.out).write_text(json.dumps({"batch": BATCH, "microbatches": MICROBATCHES,
                                          "torch": torch.__version__, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
