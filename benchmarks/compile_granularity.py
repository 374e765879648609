"""Whole-stage against block-by-block ``torch.compile`` (issue 22): forward + backward times.

    .venv/bin/python benchmarks/compile_granularity.py [--models hf_gpt2,gpt] [--rounds 8]
        [--steps 2] [--batches 2,16] [--compile-batches 2]

One thread (``torch.set_num_threads(1)``), the models of ``benchmarks/runtime.py``. Each
variant takes one forward + backward (gradients zeroed after it, no optimizer step) at batch 2
(one microbatch as the pipeline runs at K = 2, M = 8, batch 16) and at batch 16:

- ``eager``: the plain model;
- ``whole``: the whole model compiled (``model.compile()``);
- ``per-block``: each transformer block compiled on its own (``block.compile()``, as torchtitan
  does), the rest eager;
- ``stage eager`` / ``stage whole`` / ``stage per-block``: pipecut's first stage program (the
  model captured at that batch, planned for two stages and 8 microbatches, split): its fx
  GraphModule eager, compiled whole as ``compile_stages=True`` does
  (:func:`pipecut.runtime.execution.compiled.compile_stage`), and with each run of one block's nodes cut
  into a submodule (``torch.fx.passes.split_module``) compiled on its own. The stage's backward
  starts from fixed random gradients of the values it sends.

Every compiled module goes through ``compile_stage`` (inductor, ``dynamic=None``: each instance
sees one shape, so its graphs are static), whose stats give the graphs and graph breaks.

Steady time: all variants of a model are built in one process and timed in alternation, round
after round, the order rotating (``--steps`` steps each per round, median over all), since this
shared machine drifts by 20% between minutes. Compile seconds (``--compile-batches``): each
compiled variant is built and run once in a fresh process with an empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` a new directory; cold), then once more in another process on that
cache (warm); the seconds are those of the calls that compiled (Dynamo, AOTAutograd, inductor,
forward and backward). The timing process reads those caches. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from benchmarks.runtime import MODELS, _call
from pipecut.capture import capture
from pipecut.passes.rewrite.split import split_stage
from pipecut.runtime.execution.compiled import CompileStats, compile_stage

VARIANTS = ("eager", "whole", "per-block", "stage eager", "stage whole", "stage per-block")
COMPILED = tuple(v for v in VARIANTS if v.endswith(("whole", "per-block")))
BLOCKS = {"gpt": r"blocks\.\d+", "hf_gpt2": r"transformer\.h\.\d+"}  # module paths of the blocks
PIPELINE_BATCH, MICROBATCHES = 16, 8

Step = Callable[[], None]


def _sliced(inputs: Any, batch: int) -> Any:
    if isinstance(inputs, dict):
        return {k: v[:batch] for k, v in inputs.items()}
    return tuple(v[:batch] for v in inputs)


def _block_of(node: fx.Node, pattern: re.Pattern[str]) -> str | None:
    """The block module whose code made ``node`` (from its ``nn_module_stack``), if any."""
    for value in (node.meta.get("nn_module_stack") or {}).values():
        path = value[0] if isinstance(value, tuple) else str(value)
        if pattern.fullmatch(path):
            return path
    return None


def block_submodules(gm: fx.GraphModule, pattern: re.Pattern[str]) -> tuple[fx.GraphModule, list[str]]:
    """``gm`` with each maximal run of one block's nodes in a submodule of its own (torch's
    ``split_module``), and the names of the block submodules. Nodes of no block (embeddings, the
    last norm, the head) are runs of their own."""
    part: dict[str, int] = {}
    blocks: set[int] = set()
    index, last = -1, object()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        block = _block_of(node, pattern)
        if block != last:
            index, last = index + 1, block
            if block is not None:
                blocks.add(index)
        part[node.name] = index
    out = split_module(gm, gm, lambda n: part[n.name], keep_original_order=True)
    out.training = gm.training
    return out, [f"submod_{i}" for i in sorted(blocks)]


def _stage_step(name: str, batch: int, plan: pipecut.Plan, mode: str,
                stats: list[CompileStats]) -> Step:
    """Forward + backward of the first stage program at ``batch``: ``mode`` eager, whole or per-block."""
    model, inputs, _, _ = MODELS[name]()
    inputs = _sliced(inputs, batch)
    captured = capture(model, inputs)
    gm = split_stage(captured.gm, plan, 0).module
    args = [inputs[p.name] if isinstance(inputs, dict) else inputs[i]
            for i, p in enumerate(p for p in gm.graph.nodes if p.op == "placeholder")]
    torch.manual_seed(1)
    with torch.no_grad():  # eager, before compiling: no_grad is a guard, a graph of its own
        grads = [torch.randn_like(o) for o in gm(*args) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    if mode == "whole":
        stats.append(compile_stage(gm, 0))
    elif mode == "per-block":
        gm, names = block_submodules(gm, re.compile(BLOCKS[name]))
        stats += [compile_stage(gm.get_submodule(n), i) for i, n in enumerate(names)]

    def step() -> None:
        sent = [o for o in gm(*args) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        torch.autograd.backward(sent, grads)
        gm.zero_grad()
    return step


def build(name: str, variant: str, batch: int, plan: pipecut.Plan) -> tuple[Step, list[CompileStats]]:
    """One forward + backward of ``variant`` at ``batch``, and the compile stats it fills."""
    stats: list[CompileStats] = []
    if variant.startswith("stage "):
        return _stage_step(name, batch, plan, variant.removeprefix("stage "), stats), stats
    model, inputs, loss_fn, target = MODELS[name]()
    inputs, target = _sliced(inputs, batch), target[:batch]
    if variant == "whole":
        stats.append(compile_stage(model, 0))
    elif variant == "per-block":
        pattern = re.compile(BLOCKS[name])
        blocks = [m for path, m in model.named_modules() if pattern.fullmatch(path)]
        stats += [compile_stage(m, i) for i, m in enumerate(blocks)]

    def step() -> None:
        loss_fn(_call(model, inputs), target).backward()
        model.zero_grad()
    return step, stats


def make_plan(name: str) -> pipecut.Plan:
    """pipecut's plan of ``name`` for two stages, 8 microbatches of 2, 1F1B (as compile makes)."""
    model, inputs, loss_fn, target = MODELS[name]()
    return pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                        schedule="1f1b", captured=capture(model, _sliced(inputs, PIPELINE_BATCH // MICROBATCHES)))


def _summary(stats: list[CompileStats], seconds: float) -> dict[str, Any]:
    return {"s": seconds, "graphs": sum(s.graphs for s in stats), "cache_hits": sum(s.cache_hits for s in stats),
            "modules": len(stats)}


def compile_once(name: str, variant: str, batch: int, plan_json: str) -> dict[str, Any]:
    """Build ``variant`` and run its first step (which compiles), in this process."""
    step, stats = build(name, variant, batch, pipecut.Plan.from_json(plan_json))
    start = time.perf_counter()
    step()
    return _summary(stats, time.perf_counter() - start)


def _child(name: str, variant: str, batch: int, plan_path: Path, cache: Path) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", f"{name}:{variant}:{batch}:{plan_path}"],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"compiling {name} {variant} at batch {batch} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_compile(name: str, batches: list[int], plan_path: Path, caches: dict[tuple[str, int], Path]
                    ) -> dict[str, Any]:
    """Cold and warm compile seconds of each compiled variant, each in fresh processes."""
    out: dict[str, Any] = {}
    for batch in batches:
        for variant in COMPILED:
            cache = Path(tempfile.mkdtemp(prefix="pipecut-granularity-"))
            caches[variant, batch] = cache
            cold = _child(name, variant, batch, plan_path, cache)
            warm = _child(name, variant, batch, plan_path, cache)
            out[f"{variant} @{batch}"] = {"cold": cold, "warm": warm}
            print(f"  compile {variant:>15} @{batch:<2}: cold {cold['s']:6.1f} s  warm {warm['s']:5.1f} s  "
                  f"({cold['graphs']} graphs in {cold['modules']} module(s), {cold['cache_hits']} cache hits cold)",
                  flush=True)
    return out


def measure_steady(name: str, batches: list[int], plan: pipecut.Plan, rounds: int, steps: int,
                   caches: dict[tuple[str, int], Path]) -> dict[str, Any]:
    """Median step ms of every variant at every batch, timed in rotating alternation."""
    # Every compile_stage call makes a backend of its own, so each block sharing its class's code
    # is one cache entry of that code (a BACKEND_MATCH guard): this process holds the blocks of
    # both batches, past Dynamo's 8, beyond which the later blocks would run eagerly.
    torch._dynamo.config.recompile_limit = 64
    runners: dict[str, Step] = {}
    graphs: dict[str, int] = {}
    for batch in batches:
        for variant in VARIANTS:
            key = f"{variant} @{batch}"
            cache = caches.get((variant, batch))
            if cache is not None:  # warm: read what the cold run compiled
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
            runners[key], stats = build(name, variant, batch, plan)
            runners[key]()  # compiles (from the cache when there is one)
            runners[key]()
            graphs[key] = sum(s.graphs for s in stats)
    order = list(runners)
    times: dict[str, list[float]] = {k: [] for k in order}
    for r in range(rounds):
        for key in order[r % len(order):] + order[: r % len(order)]:
            for _ in range(steps):
                start = time.perf_counter()
                runners[key]()
                times[key].append((time.perf_counter() - start) * 1e3)
    return {k: {"ms": statistics.median(v), "min_ms": min(v), "graphs": graphs[k]} for k, v in times.items()}


def run(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    print(f"{name}:", flush=True)
    plan = make_plan(name)
    plan_path = work / f"{name}.plan.json"
    plan_path.write_text(plan.to_json())
    caches: dict[tuple[str, int], Path] = {}
    compile_s = measure_compile(name, args.compile_batches, plan_path, caches)
    steady = measure_steady(name, args.batches, plan, args.rounds, args.steps, caches)
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)
    row = {"model": name, "stage_nodes": [len(s.nodes) for s in plan.stages],
           "stage0_blocks": sorted({m for n in plan.stages[0].nodes
                                    if (m := _module_block(plan.node(n).module, name))}),
           "steady": steady, "compile": compile_s}
    _print(row, args.batches)
    return row


def _module_block(module: str | None, name: str) -> str | None:
    match = re.match(BLOCKS[name], module or "")
    return match.group(0) if match else None


def _print(row: dict[str, Any], batches: list[int]) -> None:
    steady = row["steady"]
    print(f"  stage 0 of {row['stage_nodes']} nodes holds {', '.join(row['stage0_blocks'])}")
    print(f"  {'variant':>16} " + " ".join(f"{'@' + str(b) + ' ms':>10} {'vs eager':>8} {'graphs':>6}" for b in batches))
    for variant in VARIANTS:
        base = "stage eager" if variant.startswith("stage") else "eager"
        cells = []
        for b in batches:
            s = steady[f"{variant} @{b}"]
            cells.append(f"{s['ms']:10.1f} {steady[f'{base} @{b}']['ms'] / s['ms']:7.2f}x {s['graphs']:6d}")
        print(f"  {variant:>16} " + " ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="hf_gpt2,gpt")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batches", default="2,16")
    parser.add_argument("--compile-batches", default="2")
    parser.add_argument("--out", default=str(Path(__file__).with_name("compile_granularity.json")))
    parser.add_argument("--child", help=argparse.SUPPRESS)  # model:variant:batch:plan path
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        name, variant, batch, plan_path = args.child.split(":", 3)
        print(json.dumps(compile_once(name, variant, int(batch), Path(plan_path).read_text())))
        return
    args.batches = [int(b) for b in args.batches.split(",")]
    args.compile_batches = [int(b) for b in args.compile_batches.split(",") if b]
    work = Path(tempfile.mkdtemp(prefix="pipecut-granularity-plans-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pipecut-granularity-")  # batch 16
    start = time.perf_counter()
    rows = [run(name, args, work) for name in args.models.split(",")]
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    Path(args.out).write_text(json.dumps({
        "torch": torch.__version__, "threads": 1, "batches": args.batches, "rounds": args.rounds,
        "steps": args.steps, "seconds": time.perf_counter() - start, "rows": rows}, indent=1))
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
