"""Tensor parallelism on CPU: a TP 2 x PP 2 step (with and without sequence parallelism) against PP 4
and PP 2 x DP 2 on the same 4 ranks.

    .venv/bin/python benchmarks/tensor_parallel.py [--rounds 3] [--steps 2] [--size demo|small]
        [--out benchmarks/tensor_parallel.json]

Four forked CPU ranks on gloo, one thread each, the GPT example (examples/gpt.py: tied input and
output embeddings, a fused qkv projection), 1F1B, one batch per step. The four layouts are
compiled once on the same ranks, then timed in alternation, round by round and in a rotating
order, so that the machine's drift hits all of them alike:

- ``tp2xpp2``: a ("pp", "tp") mesh of 2 x 2: two stages, each split over 2 ranks as DTensors
  (the split found from the graph: the MLP's column/row pair, qkv and proj, the tied head);
- ``tp2xpp2-sp``: the same with sequence parallelism (norms and residual adds on token shards,
  reduce-scatter and all-gather in place of each all-reduce);
- ``pp4``: four stages, one per rank;
- ``pp2xdp2``: a ("dp", "pp") mesh of 2 x 2: two replicas (DDP) of two stages, each on its half.

All four give the plain model's numbers (tests/multiprocess/test_tensor_parallel.py, test_hybrid.py).
Prints a table (median ms per step) and writes JSON. Not a test: no speed is asserted anywhere.
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
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from examples import gpt
from tests.harness import run_ranks

LAYOUTS = ("tp2xpp2", "tp2xpp2-sp", "pp4", "pp2xdp2")
BATCH, MICROBATCHES = 16, 4
SIZES = {"demo": {}, "small": {"vocab": 512, "dim": 128, "heads": 4, "layers": 4, "seq": 64}}


def _build(size: str) -> tuple[Any, Any, Any, Any]:
    if size == "demo":
        return gpt.build_demo(BATCH)
    return gpt.build(BATCH, **SIZES[size])


def _compile(layout: str, world: int, size: str) -> tuple[Any, Any, Any]:
    model, inputs, loss_fn, target = _build(size)
    microbatches, kwargs = MICROBATCHES, {}
    if layout.startswith("tp2xpp2"):
        devices: Any = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
        kwargs = {"tensor_parallel": pipecut.TensorParallelOptions(sequence_parallel=layout.endswith("-sp"))}
    elif layout == "pp2xdp2":
        devices = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "pp"))
        replica = devices.get_local_rank("dp")
        half = slice(BATCH // 2 * replica, BATCH // 2 * (replica + 1))  # each replica steps on its half
        inputs, target, microbatches = (inputs[0][half],), target[half], MICROBATCHES // 2
        kwargs = {"data_parallel": "ddp"}
    else:
        devices = world
    pipe = pipecut.compile(model, inputs, devices, loss_fn=loss_fn, target=target, microbatches=microbatches,
                           schedule="1f1b", runtime=pipecut.RuntimeOptions(timeout=600),
                           measure=pipecut.MeasureOptions(calibration_steps=0), **kwargs)
    return pipe, inputs, target


def _steps(pipe: Any, inputs: Any, target: Any, steps: int) -> float:
    """Milliseconds per step, from the first rank's start to the last rank's end."""
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        pipe.step(inputs, target)
    torch.distributed.barrier()
    elapsed = (time.perf_counter() - start) * 1e3 / steps
    for p in pipe.parameters():
        p.grad = None
    return elapsed


def _rank(rank: int, world: int, rounds: int, steps: int, size: str) -> dict[str, Any]:
    pipes = {layout: _compile(layout, world, size) for layout in LAYOUTS}
    for pipe, inputs, target in pipes.values():
        _steps(pipe, inputs, target, 1)  # warm-up
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for r in range(rounds):
        order = LAYOUTS[r % len(LAYOUTS):] + LAYOUTS[:r % len(LAYOUTS)]
        for layout in order:
            times[layout].append(_steps(*pipes[layout], steps))
    return {"times": times, "stages": {k: p.plan.num_stages for k, (p, _, _) in pipes.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed window")
    parser.add_argument("--size", choices=sorted(SIZES), default="demo")
    parser.add_argument("--out", default="benchmarks/tensor_parallel.json")
    args = parser.parse_args()
    res = run_ranks(_rank, 4, args.rounds, args.steps, args.size, timeout=3600, collective_timeout=600)
    times = res[0]["times"]
    base = statistics.median(times["pp4"])
    rows = [{"layout": layout, "median_ms_per_step": statistics.median(times[layout]),
             "vs_pp4": statistics.median(times[layout]) / base, "raw_ms_per_step": times[layout],
             "stages": res[0]["stages"][layout]} for layout in LAYOUTS]
    print(f"GPT example ({args.size}), batch {BATCH}, 1F1B, 4 CPU ranks (gloo, 1 thread each), "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'layout':<10}{'stages':>8}{'ms/step':>12}{'vs pp4':>10}")
    for r in rows:
        print(f"{r['layout']:<10}{r['stages']:>8}{r['median_ms_per_step']:>12.1f}{r['vs_pp4']:>10.2f}")
    Path(args.out).write_text(json.dumps({"size": args.size, "batch": BATCH, "microbatches": MICROBATCHES,
                                          "rounds": args.rounds, "steps": args.steps, "rows": rows},
                                         indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
