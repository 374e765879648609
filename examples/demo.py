"""The demo: plan and train the GPT example on 2 CPU processes, against one plain process.

    torchrun --nproc_per_node=2 examples/demo.py [--steps 10] [--schedule gpipe]

Every rank runs this script. Rank 0 profiles and partitions the model, writes ``plan.json`` and
prints the plan; all ranks then train. Afterwards rank 0 trains the unsplit model alone for the
same number of steps (same batch, one thread, the other rank idle) and prints both step times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from examples.gpt import build_demo


def timed_steps(step, steps: int, warmup: int = 2) -> list[float]:  # type: ignore[no-untyped-def]
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = step()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times, loss  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="gpipe", choices=[s.value for s in pipecut.ScheduleKind])
    parser.add_argument("--plan-out", default="plan.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, inputs, loss_fn, target = build_demo(batch_size=16)
    pipe = pipecut.compile(
        model, inputs, 2, loss_fn=loss_fn, target=target,
        microbatches=args.microbatches, schedule=args.schedule,
    )
    rank = dist.get_rank()
    if rank == 0:
        pipe.plan.to_json(args.plan_out)
        print(f"plan written to {args.plan_out}\n{pipecut.summary(pipe.plan)}\n", flush=True)

    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)

    def pipeline_step() -> float:
        loss = pipe.step(inputs, target)
        opt.step()
        opt.zero_grad()
        return loss.item()

    pipe_ms, pipe_loss = timed_steps(pipeline_step, args.steps)
    dist.barrier()
    if rank == 0:
        ref_model, _, _, _ = build_demo(batch_size=16)
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)

        def plain_step() -> float:
            loss = loss_fn(ref_model(*inputs), target)
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            return loss.item()

        plain_ms, plain_loss = timed_steps(plain_step, args.steps)
        p, s = statistics.median(pipe_ms), statistics.median(plain_ms)
        print(f"{'':22}{'step ms (median)':>18}{'final loss':>12}")
        print(f"{'pipecut, 2 processes':22}{p:18.1f}{pipe_loss:12.4f}")
        print(f"{'one process':22}{s:18.1f}{plain_loss:12.4f}")
        print(f"speedup {s / p:.2f}x over one process (1 thread each, {args.steps} steps, "
              f"batch 16 in {args.microbatches} microbatches, {args.schedule}); "
              f"predicted step {pipe.plan.predicted.step_ms:.1f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
