"""Gradient accumulation: what ``pipe.no_sync()`` saves over reducing on every step.

    .venv/bin/python benchmarks/accumulation.py [--rounds 3] [--window 4] [--layouts dp2,pp2]
        [--out benchmarks/accumulation.json]

Two forked CPU ranks on gloo, one thread each, the GPT example at the demo's size (tied input
and output embeddings), 1F1B. A window is ``--window`` steps of a batch each, then the optimizer
would step; it is timed two ways, alternating round by round so that the machine's drift hits
both alike:

- ``every step``: each step reduces its gradients across ranks (exact, the default);
- ``no_sync``: the steps but the last run under ``pipe.no_sync()``, and the last reduces once.

Layouts: ``dp2`` is two data-parallel replicas of a one-stage pipeline (DDP all-reduces every
gradient: the case no_sync exists for); ``pp2`` is one pipeline of two stages, where only the
tied embedding's gradient crosses ranks. Both modes give the same gradients
(``tests/multiprocess/test_tied.py``). Prints a table and writes JSON. Not a test.
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

BATCH, MICROBATCHES = 16, 8


def _compile(layout: str, world: int) -> tuple[Any, Any, Any]:
    model, inputs, loss_fn, target = gpt.build_demo(BATCH)
    if layout == "dp2":  # each replica steps on its half of every batch
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "pp"))
        half = slice(BATCH // world * mesh.get_local_rank("dp"), BATCH // world * (mesh.get_local_rank("dp") + 1))
        inputs, target = (inputs[0][half],), target[half]
        pipe = pipecut.compile(
            model, inputs, mesh, loss_fn=loss_fn, target=target,
            microbatches=MICROBATCHES // world, schedule="1f1b",
            runtime=pipecut.RuntimeOptions(timeout=300),
            measure=pipecut.MeasureOptions(calibration_steps=0),
        )
    else:
        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target,
            microbatches=MICROBATCHES, schedule="1f1b", runtime=pipecut.RuntimeOptions(timeout=300),
            measure=pipecut.MeasureOptions(calibration_steps=0),
        )
    return pipe, inputs, target


def _window(pipe: Any, inputs: Any, target: Any, steps: int, no_sync: bool) -> float:
    torch.distributed.barrier()
    start = time.perf_counter()
    for i in range(steps):
        if no_sync and i < steps - 1:
            with pipe.no_sync():
                pipe.step(inputs, target)
        else:
            pipe.step(inputs, target)
    torch.distributed.barrier()
    elapsed = (time.perf_counter() - start) * 1e3
    for p in pipe.parameters():
        p.grad = None
    return elapsed


def _rank(rank: int, world: int, layout: str, rounds: int, steps: int) -> dict[str, Any]:
    pipe, inputs, target = _compile(layout, world)
    _window(pipe, inputs, target, 1, False)  # warm-up
    times: dict[str, list[float]] = {"every": [], "no_sync": []}
    for r in range(rounds):
        order = ("every", "no_sync") if r % 2 == 0 else ("no_sync", "every")
        for mode in order:
            times[mode].append(_window(pipe, inputs, target, steps, mode == "no_sync"))
    return {"times": times, "stages": pipe.plan.num_stages, "tied": [t.fqn for t in pipe.plan.tied]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=4, help="steps per accumulation window")
    parser.add_argument("--layouts", default="dp2,pp2")
    parser.add_argument("--out", default="benchmarks/accumulation.json")
    args = parser.parse_args()
    rows = []
    for layout in args.layouts.split(","):
        res = run_ranks(_rank, 2, layout, args.rounds, args.window, timeout=3600, collective_timeout=600)
        every = statistics.median(res[0]["times"]["every"])
        no_sync = statistics.median(res[0]["times"]["no_sync"])
        rows.append({"layout": layout, "window_steps": args.window, "every_step_ms": every,
                     "no_sync_ms": no_sync, "saved_ms": every - no_sync, "saved_fraction": 1 - no_sync / every,
                     "raw": res[0]["times"], "tied": res[0]["tied"]})
    print(f"{'layout':<8}{'window':>8}{'every step ms':>16}{'no_sync ms':>14}{'saved':>10}")
    for r in rows:
        print(f"{r['layout']:<8}{r['window_steps']:>8}{r['every_step_ms']:>16.1f}{r['no_sync_ms']:>14.1f}"
              f"{r['saved_fraction']:>10.1%}")
    Path(args.out).write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
