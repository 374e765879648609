"""Attention under tensor parallelism on CPU: transformers' default attention (SDPA, run on each
rank's own heads) against eager attention (products and a softmax through DTensor), and the path
SDPA took before (DTensor's propagation through the CPU flash kernel's decomposition).

    .venv/bin/python benchmarks/tp_attention.py [--rounds 3] [--steps 2] [--old-limit 180]
        [--out benchmarks/tp_attention.json]

Four forked CPU ranks on gloo, one thread each, a ("pp", "tp") mesh of 2 x 2, 1F1B, a
transformers Llama (4 layers, hidden 64, 4 heads over 2 key/value heads: the issue's model),
batch 8 x 16 tokens in 4 microbatches. ``sdpa`` and ``eager`` are compiled on the same ranks
(compile time each: capture, profile, plan, build), then their steps are timed in alternation,
round by round, so that the machine's drift hits both alike. ``old`` compiles the SDPA model
with local heads switched off (the build's attention left to DTensor), in ranks of its own
that are killed at ``--old-limit`` seconds: it reports how far it got. Both timed paths give
the plain model's numbers (tests/multiprocess/test_tensor_parallel.py). Not a test: no speed is
asserted anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from benchmarks.tensor_parallel import _steps as timed_steps
from examples import zoo
from tests.harness import run_ranks

BATCH, MICROBATCHES, LAYERS = 8, 4, 4


def _build(attention: str | None) -> zoo.Built:
    return zoo.llama(batch_size=BATCH, layers=LAYERS, attention=attention)


def _compile(attention: str | None, mesh: Any) -> tuple[Any, Any, Any, float]:
    model, inputs, loss_fn, target = _build(attention)
    start = time.perf_counter()
    pipe = pipecut.compile(model, inputs, mesh, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                           schedule="1f1b", runtime=pipecut.RuntimeOptions(timeout=600))
    return pipe, inputs, target, time.perf_counter() - start


def _rank(rank: int, world: int, rounds: int, steps: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    built = {name: _compile(attention, mesh) for name, attention in (("sdpa", None), ("eager", "eager"))}
    times: dict[str, list[float]] = {name: [] for name in built}
    for r in range(rounds):
        for name in (list(built) if r % 2 == 0 else list(reversed(built))):
            pipe, inputs, target, _ = built[name]
            times[name].append(timed_steps(pipe, inputs, target, steps))
    return {"compile_s": {n: b[3] for n, b in built.items()}, "step_ms": times}


def _old(rank: int, world: int) -> float:
    """The SDPA model compiled with attention left to DTensor, as before local heads."""
    from pipecut.assemble import tensor

    ends = tensor.region_ends
    tensor.region_ends = lambda mesh, sequence_parallel=False: dataclasses.replace(  # type: ignore[assignment]
        ends(mesh, sequence_parallel), heads=None)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pipe, inputs, target, seconds = _compile(None, mesh)
    pipe.step(inputs, target)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed window")
    parser.add_argument("--old-limit", type=float, default=180.0, help="seconds before the old path's ranks are killed")
    parser.add_argument("--out", default="benchmarks/tp_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ranks = run_ranks(_rank, 4, args.rounds, args.steps, timeout=1800, collective_timeout=900)
    start = time.perf_counter()
    try:
        old: dict[str, Any] = {"compile_and_step_s": run_ranks(_old, 4, timeout=args.old_limit, collective_timeout=900)[0]}
    except Exception as e:  # killed at the limit, or failed
        lines = [line for line in str(e).splitlines() if line.strip()]
        old = {"stopped_after_s": round(time.perf_counter() - start, 1), "outcome": (lines or ["?"])[-1][:300]}
    step = {n: statistics.median(t for r in ranks for t in r["step_ms"][n]) for n in ("sdpa", "eager")}
    compile_s = {n: max(r["compile_s"][n] for r in ranks) for n in ("sdpa", "eager")}
    print("| attention | compile s | step ms (median) |\n|---|---:|---:|")
    for n in ("sdpa", "eager"):
        print(f"| {n} | {compile_s[n]:.1f} | {step[n]:.1f} |")
    print(f"| sdpa through DTensor (before) | {old} | |")
    print(f"sdpa / eager step: {step['sdpa'] / step['eager']:.2f}")
    meta = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "command": sys.argv, "rounds": args.rounds, "steps": args.steps}
    Path(args.out).write_text(json.dumps({"meta": meta, "compile_s": compile_s, "step_ms": step,
                                          "ratio_sdpa_over_eager": step["sdpa"] / step["eager"], "old": old},
                                         indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
