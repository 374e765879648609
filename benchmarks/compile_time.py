"""Compile-time benchmark: how long ``pipecut.plan`` takes (capture + profile + partition).

    .venv/bin/python benchmarks/compile_time.py [--runs 3] [--models hf_gpt2,gpt] [--profile]

For each model and setting, ``--runs`` fresh processes (one thread each) build the model and
time ``pipecut.plan`` twice: the first plan ("cold", what a script that plans once pays:
torch.export's first-call setup included, imports and model building not) and a second one
("warm"). Medians are reported with the split and the predicted step each plan chose, so that a
faster planner that plans worse shows up here. Settings: ``microbatches=8`` with 1F1B (what
``benchmarks/runtime.py`` and the demo ask for), and ``microbatches="auto"`` (profiles at two
microbatch sizes, then plans the chosen pair). Both calibrate on whole stages, the default.

``--profile`` prints cProfile's top functions for the first model and setting instead.
Prints a table and writes JSON. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from examples import gpt

BATCH = 16
SETTINGS: dict[str, dict[str, Any]] = {
    "m8-1f1b": {"microbatches": 8, "schedule": "1f1b"},
    "auto": {"microbatches": "auto", "schedule": "1f1b"},
}


def hf_gpt2(batch_size: int = BATCH, seed: int = 0, layers: int = 8) -> tuple[Any, Any, Any, Any]:
    """transformers GPT-2 from a config (random weights): 8 layers, width 256, batch 16."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=layers, n_head=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 2048, (batch_size, 129))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    return model, {"input_ids": tokens[:, :-1]}, loss_fn, tokens[:, 1:]


MODELS: dict[str, Callable[..., Any]] = {"hf_gpt2": hf_gpt2, "gpt": gpt.build_demo}


def plan_once(name: str, setting: str) -> tuple[float, pipecut.Plan]:
    model, inputs, loss_fn, target = MODELS[name](BATCH)
    start = time.perf_counter()
    made = pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, **SETTINGS[setting])
    return time.perf_counter() - start, made


def describe(made: pipecut.Plan) -> dict[str, Any]:
    return {
        "split_at": [made.node(s.nodes[0]).module or s.nodes[0] for s in made.stages[1:]],
        "stage_nodes": [len(s.nodes) for s in made.stages],
        "microbatches": made.microbatches,
        "schedule": made.schedule.value,
        "predicted_ms": made.predicted.step_ms,
        "stage_ms": [round(s.forward_ms + s.backward_ms, 3) for s in made.stages],
    }


def one(name: str, setting: str) -> dict[str, Any]:
    """In this (fresh) process: the first plan (cold: what a user's script pays) and a second
    one (warm: torch's one-time costs, such as export's first-call setup, already paid)."""
    cold, made = plan_once(name, setting)
    warm, again = plan_once(name, setting)
    return {"cold": cold, "warm": warm, "plans": [describe(made), describe(again)]}


def run(names: list[str], settings: list[str], runs: int) -> list[dict[str, Any]]:
    """Each run in a fresh process, so that every cold number is a real first plan."""
    rows = []
    for name in names:
        for setting in settings:
            results = []
            for _ in range(runs):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", f"{name}:{setting}"],
                    check=True, capture_output=True, text=True,
                ).stdout
                results.append(json.loads(out.strip().splitlines()[-1]))
            row = {
                "model": name, "setting": setting,
                "cold_s": statistics.median(r["cold"] for r in results),
                "warm_s": statistics.median(r["warm"] for r in results),
                "cold_samples": [round(r["cold"], 2) for r in results],
                "warm_samples": [round(r["warm"], 2) for r in results],
                "plans": [p for r in results for p in r["plans"]],
            }
            rows.append(row)
            print_row(row)
    return rows


def print_row(r: dict[str, Any]) -> None:
    splits = sorted({str(p["split_at"]) for p in r["plans"]})
    predicted = statistics.median(p["predicted_ms"] for p in r["plans"])
    counts = sorted({f"M={p['microbatches']} {p['schedule']}" for p in r["plans"]})
    print(f"{r['model']:8} {r['setting']:8} cold {r['cold_s']:5.2f} s {r['cold_samples']}  warm "
          f"{r['warm_s']:5.2f} s {r['warm_samples']}  {', '.join(counts)}; split at {', '.join(splits)}; "
          f"predicted step {predicted:.0f} ms (median)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--profile", action="store_true", help="cProfile one plan and print the top")
    parser.add_argument("--one", help="model:setting; internal: one run, JSON on stdout")
    parser.add_argument("--out", default=str(Path(__file__).with_name("compile_time.json")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    names, settings = args.models.split(","), args.settings.split(",")
    if args.one:
        print(json.dumps(one(*args.one.split(":"))))
        return
    if args.profile:
        plan_once(names[0], settings[0])
        prof = cProfile.Profile()
        prof.enable()
        plan_once(names[0], settings[0])
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
        return
    rows = run(names, settings, args.runs)
    Path(args.out).write_text(json.dumps({"batch": BATCH, "torch": torch.__version__, "threads": 1,
                                          "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
