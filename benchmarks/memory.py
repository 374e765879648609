"""Memory benchmark: a model built on the meta device trained on K forked CPU ranks, none of
which ever holds the whole model.

    .venv/bin/python benchmarks/memory.py [--mib 512] [--ranks 4,8] [--steps 3] [--weights] [--lean] [--pippy]

The model is a residual MLP (``x + W(gelu(x))`` blocks of width 2048, float32) of ``--mib``
MiB of parameters, built under ``torch.device("meta")``. Every rank runs ``pipecut.compile``
(rank 0 captures and profiles it one node at a time on scratch weights), materialises only its
stage (split with a per-rank memory capacity of ``--slack`` times an even share, so that the
plan balances memory as well as time; initialised by ``reset_parameters`` under per-module seeds, or with ``--weights`` read
from a safetensors file written beforehand by a separate process), and trains ``--steps`` steps
with SGD (no optimizer state). Per rank: the peak RSS growth from just before the model is built
to the end (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), the plan's predicted
peak for that stage (params + grads + in-flight activations; the plan's own figure adds AdamW
state, which SGD does not keep, so it is shown too), and the median step time. Not a test:
numbers depend on the machine and on whatever else runs on it. ``--lean`` compiles with
``lean_host_memory=True``; ``--pippy`` adds torch.distributed.pipelining's GPipe on the same
model (built whole on every rank, as its ``pipeline()`` needs), split into K equal block runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from pipecut.passes.costs.stages import OPTIMIZER_STATE_FACTOR
from tests.harness import run_ranks

WIDTH, BATCH, MICROBATCHES = 2048, 16, 4
MIB = 1 << 20


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(nn.functional.gelu(x))


class ResidualMLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def depth_for(mib: int) -> int:
    return max(1, round(mib * MIB / ((WIDTH * WIDTH + WIDTH) * 4)))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(rank: int, world: int, depth: int, steps: int, weights: str | None,
          capacity: int | None, real: bool, lean: bool) -> dict:
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    y = torch.randint(0, 10, (BATCH,))
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    base = _status("VmRSS")
    with torch.device("cpu" if real else "meta"):  # --real: every rank builds the whole model
        model = ResidualMLP(WIDTH, depth)
    devices = [pipecut.DeviceSpec(name="cpu", memory_bytes=capacity)] * world if capacity else world
    pipe = pipecut.compile(
        model, (x,), devices, loss_fn=nn.functional.cross_entropy, target=y,
        microbatches=MICROBATCHES, weights=weights,
        runtime=pipecut.RuntimeOptions(timeout=600, lean_host_memory=lean),
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pipe.step((x,), y)
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append((time.perf_counter() - start) * 1e3)
    stage = pipe.plan.stages[pipe.stage]
    return {
        "growth": _status("VmHWM") - base,
        "plan_peak": stage.peak_memory_bytes,
        "predicted": stage.peak_memory_bytes - OPTIMIZER_STATE_FACTOR * stage.param_bytes,
        "param_bytes": stage.param_bytes,
        "step_ms": statistics.median(times[1:] or times),
    }


def _pippy_rank(rank: int, world: int, depth: int, steps: int, lean: bool) -> dict:
    """The same model and batch under torch.distributed.pipelining's GPipe: every rank builds
    the whole model for real (``pipeline()`` traces it whole), keeps its stage, drops the rest."""
    import gc

    from benchmarks.runtime import pippy_gpipe
    from pipecut.runtime.memory.allocator import return_large_frees

    if lean:
        return_large_frees()
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    y = torch.randint(0, 10, (BATCH,))
    Path("/proc/self/clear_refs").write_text("5")
    base = _status("VmRSS")
    model = ResidualMLP(WIDTH, depth)
    splits = [f"blocks.{depth * s // world}" for s in range(1, world)]
    stage, step = pippy_gpipe(model, (x,), splits, rank, MICROBATCHES, nn.functional.cross_entropy)
    del model
    gc.collect()
    opt = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step((x,), y)
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append((time.perf_counter() - start) * 1e3)
    return {
        "growth": _status("VmHWM") - base,
        "param_bytes": sum(p.numel() * p.element_size() for p in stage.submod.parameters()),
        "step_ms": statistics.median(times[1:] or times),
    }


def _write_weights(depth: int, path: str) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file(ResidualMLP(WIDTH, depth).state_dict(), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--weights", action="store_true", help="load from a safetensors file")
    parser.add_argument("--real", action="store_true",
                        help="for contrast: build the model on CPU on every rank, as before")
    parser.add_argument("--slack", type=float, default=1.05,
                        help="per-rank memory capacity given to the planner, as a multiple of "
                             "an even share (params, grads, AdamW state); 0: no capacity")
    parser.add_argument("--lean", action="store_true",
                        help="compile(..., lean_host_memory=True): freed blocks of 1 MiB or more go "
                             "back to the system at once (slower steps)")
    parser.add_argument("--pippy", action="store_true",
                        help="also run the model under torch.distributed.pipelining's GPipe")
    args = parser.parse_args()
    depth = depth_for(args.mib)
    with torch.device("meta"):
        model_bytes = sum(p.numel() * 4 for p in ResidualMLP(WIDTH, depth).parameters())
    weights = None
    if args.weights:  # written by another process, so that no rank inherits the model's pages
        weights = f"/tmp/pipecut-memory-{depth}.safetensors"
        proc = mp.get_context("spawn").Process(target=_write_weights, args=(depth, weights))
        proc.start()
        proc.join()
    print(f"model: residual MLP, width {WIDTH}, {depth} blocks, {model_bytes / MIB:.0f} MiB of "
          f"parameters; target: peak RSS growth per rank <= 0.75 x model = "
          f"{0.75 * model_bytes / MIB:.0f} MiB")
    print("| K | rank | stage params MiB | predicted peak MiB (SGD) | plan peak MiB (AdamW) "
          "| measured peak growth MiB | growth / model | step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for k in (int(s) for s in args.ranks.split(",")):
        share = (2 + OPTIMIZER_STATE_FACTOR) * model_bytes / k
        capacity = int(args.slack * share) if args.slack > 0 else None
        results = run_ranks(_rank, k, depth, args.steps, weights, capacity, args.real, args.lean,
                            timeout=3000, collective_timeout=900)
        for r, res in enumerate(results):
            print(f"| {k} | {r} | {res['param_bytes'] / MIB:.0f} | {res['predicted'] / MIB:.0f} | "
                  f"{res['plan_peak'] / MIB:.0f} | {res['growth'] / MIB:.0f} | "
                  f"{res['growth'] / model_bytes:.2f} | {res['step_ms']:.0f} |")
        if args.pippy:
            for r, res in enumerate(run_ranks(_pippy_rank, k, depth, args.steps, args.lean,
                                              timeout=3000, collective_timeout=900)):
                print(f"| {k} (torch.distributed.pipelining) | {r} | {res['param_bytes'] / MIB:.0f} | | | "
                      f"{res['growth'] / MIB:.0f} | {res['growth'] / model_bytes:.2f} | {res['step_ms']:.0f} |")


if __name__ == "__main__":
    main()
