"""Compiled against eager stages, timed in alternation on one pair of ranks (issue 22).

    .venv/bin/python benchmarks/compiled.py [--models hf_gpt2,gpt] [--rounds 5] [--steps 2] [--schedule 1f1b] [--tensor 1]

Two forked CPU ranks on gloo, one thread each; batch 16 in 8 microbatches, 1F1B or
``--schedule`` (under zero-bubble and ZBV the stages compile apart from their weight ops; the
models of ``benchmarks/runtime.py``). ``--tensor 2``: each stage split over two ranks (a
("pp", "tp") mesh, DTensor, stages compiled apart from their parameter ops and region ends), so
four ranks share the two cores. In one fork: pipecut with eager stages and pipecut with
``compile_stages=True`` (each planned and calibrated on the running ranks as ``compile`` does,
so each prediction is of the stages it runs), and on rank 0 the plain model eager and compiled
(``model.compile()``), the other rank idle. Round after round every runner takes ``--steps``
steps in turn, the order rotating, so all four see the same machine: on a shared machine only
ratios taken this way mean something. Step time is the median; compile times are the cold
ones of this run (an empty inductor cache shared by both ranks and the single process), with
the seconds each pipecut rank spent in the calls that compiled. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from benchmarks.runtime import MICROBATCHES, MODELS, WORLD, _call, _timed, _timeline_summary
from tests.harness import run_ranks


def _rank(rank: int, world: int, name: str, rounds: int, steps: int, schedule: str, tensor: int = 1) -> dict[str, Any]:
    model, inputs, loss_fn, target = MODELS[name]()
    devices: Any = world
    if tensor > 1:
        from torch.distributed.device_mesh import init_device_mesh
        devices = init_device_mesh("cpu", (world // tensor, tensor), mesh_dim_names=("pp", "tp"))
    kw: dict[str, Any] = dict(example_inputs=inputs, loss_fn=loss_fn, target=target,
                              microbatches=MICROBATCHES, schedule=schedule)
    eager = pipecut.compile(model, devices=devices, runtime=pipecut.RuntimeOptions(timeout=600), **kw)
    start = time.perf_counter()
    compiled = pipecut.compile(
        MODELS[name]()[0], devices=devices, runtime=pipecut.RuntimeOptions(timeout=600, compile_stages=True), **kw,
    )
    build_s = time.perf_counter() - start  # capture, plan, calibration steps (which compile)

    def pipe_step(pipe: Any) -> Callable[[], None]:
        def step() -> None:
            pipe.step(inputs, target)
            for module in pipe.modules:
                module.zero_grad()
        return step

    runners: dict[str, Callable[[], None]] = {"pipecut eager": pipe_step(eager),
                                              "pipecut compiled": pipe_step(compiled)}
    single_first_s = None
    if rank == 0:
        for label, plain in (("one process eager", MODELS[name]()[0]), ("one process compiled", MODELS[name]()[0])):
            if label.endswith("compiled"):
                plain.compile()

            def single(plain: Any = plain) -> None:
                loss_fn(_call(plain, inputs), target).backward()
                plain.zero_grad()
            runners[label] = single
        single_first_s = _timed(runners["one process compiled"], 1)[0] / 1e3
    order = ["pipecut eager", "pipecut compiled", "one process eager", "one process compiled"]
    times: dict[str, list[float]] = {k: [] for k in order}
    for label in order:  # warm-up
        dist.barrier()
        if label in runners:
            _timed(runners[label], 2)
    for r in range(rounds):
        for label in order[r % 4:] + order[: r % 4]:
            dist.barrier()
            if label in runners:
                times[label] += _timed(runners[label], steps)
    dist.barrier()
    compiled.step(inputs, target, record=True)
    return {
        "ms": {k: statistics.median(v) for k, v in times.items() if v},
        "predicted_ms": {"pipecut eager": eager.plan.predicted.step_ms,
                         "pipecut compiled": compiled.plan.predicted.step_ms},
        "stage_nodes": [len(s.nodes) for s in compiled.plan.stages],
        "eager_stage_nodes": [len(s.nodes) for s in eager.plan.stages],
        "build_s": build_s, "single_first_step_s": single_first_s,
        "compile": [dataclasses.asdict(s) for s in compiled.compile_stats],
        "timeline": _timeline_summary(compiled.timeline, compiled.plan, rank),
    }


def run(name: str, rounds: int, steps: int, schedule: str = "1f1b", tensor: int = 1) -> dict[str, Any]:
    res = run_ranks(_rank, WORLD * tensor, name, rounds, steps, schedule, tensor, timeout=3000, collective_timeout=1200)
    ms, predicted = res[0]["ms"], res[0]["predicted_ms"]
    row = {
        "model": name, "schedule": schedule, "tensor_parallel": tensor, "ms": ms, "predicted_ms": predicted,
        "prediction_error": {k: (predicted[k] - ms[k]) / ms[k] for k in predicted},
        "compiled_over_eager_pipecut": ms["pipecut eager"] / ms["pipecut compiled"],
        "compiled_pipecut_over_one_compiled_process": ms["one process compiled"] / ms["pipecut compiled"],
        "eager_pipecut_over_one_eager_process": ms["one process eager"] / ms["pipecut eager"],
        "compile_s": max(sum(c["seconds"] for c in r["compile"]) for r in res),
        "graphs": [sum(c["graphs"] for c in r["compile"]) for r in res],
        "build_s": max(r["build_s"] for r in res), "single_first_step_s": res[0]["single_first_step_s"],
        "stage_nodes": res[0]["stage_nodes"], "eager_stage_nodes": res[0]["eager_stage_nodes"],
        "timeline": [r["timeline"] for r in res],
    }
    print(f"{name}: " + "  ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    print(f"  compiled / eager pipecut {row['compiled_over_eager_pipecut']:.2f}x   compiled pipecut / one "
          f"compiled process {row['compiled_pipecut_over_one_compiled_process']:.2f}x   eager pipecut / one "
          f"eager process {row['eager_pipecut_over_one_eager_process']:.2f}x")
    print("  predicted " + "  ".join(f"{k} {predicted[k]:.1f} ms ({row['prediction_error'][k]:+.0%})" for k in predicted))
    print(f"  compile (cold): pipecut ranks {row['compile_s']:.0f} s in calls that compiled ({row['graphs']} graphs), "
          f"compile() with calibration {row['build_s']:.0f} s; one process first step {row['single_first_step_s']:.0f} s")
    for t in row["timeline"]:
        print(f"  compiled r{t['rank']}: F {t['forward_ms'] or 0:.1f}/{t['predicted_forward_ms']:.1f} "
              f"B {t['backward_ms'] or 0:.1f}/{t['predicted_backward_ms']:.1f} ms per microbatch "
              f"(measured/predicted), busy {t['busy_ms'] / t['recorded_step_ms']:.0%}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--models", default="hf_gpt2,gpt")
    parser.add_argument("--schedule", default="1f1b", choices=[k.value for k in pipecut.ScheduleKind])
    parser.add_argument("--tensor", type=int, default=1, help="T: ranks that split each stage (DTensor)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("compiled.json")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pipecut-inductor-")
    rows = [run(name, args.rounds, args.steps, args.schedule, args.tensor) for name in args.models.split(",")]
    Path(args.out).write_text(json.dumps({"batch": 16, "microbatches": MICROBATCHES, "ranks": WORLD * args.tensor,
                                          "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
