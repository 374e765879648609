"""Simulated scale: the schedule simulator and the D × K planner on 64 to 1,024 devices.

    .venv/bin/python benchmarks/scale.py            # both tables, markdown on stdout

1. Simulator: ``runtime.schedule.simulate`` (reference) against ``passes.fastsim`` on K stages
   of equal cost, M microbatches, both schedules; the two must agree.
2. Planner: ``passes.hybrid.plan_hybrid`` on a synthetic 96-layer transformer
   (``passes.synthetic.transformer_costs``; 3,751 units, 39 GB of BF16 parameters, microbatch of
   16 sequences of 512 tokens, width 4096) for N devices of 80 GB, global batch 1,024 in 64
   microbatches, 1F1B, 25 GB/s and 10 µs per message between stages and in the all-reduce
   ring (one InfiniBand HDR port per GPU). The synthetic times model a 50 GFLOP/s CPU; they are
   divided by 3,000 (matrix products at 150 TFLOP/s, about half an A100's BF16 peak).
Times are wall-clock on this machine (2 shared cores); predictions are the planner's model.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from pipecut.passes.fastsim import simulate_kind
from pipecut.passes.hybrid import plan_hybrid, workload
from pipecut.passes.synthetic import Shape, transformer_costs
from pipecut.plan import Link, ScheduleKind
from pipecut.runtime.schedule import build, simulate

DEVICES = (64, 128, 256, 512, 1024)
SPEEDUP = 3000.0
NETWORK = Link(bandwidth_bytes_per_ms=25e6, latency_ms=0.01)
MEMORY = 80 * 10**9


def simulator_table(microbatches: int) -> list[str]:
    rows = [
        "| stages | schedule | M | reference simulate s | fastsim s | step ms (both) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for k in DEVICES:
        for kind in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B):
            f, b, link = [1.0] * k, [2.0] * k, [0.1] * (k - 1)
            start = time.perf_counter()
            ref = simulate(build(kind, k, microbatches), f, b, link)
            ref_s = time.perf_counter() - start
            start = time.perf_counter()
            fast = simulate_kind(kind, f, b, microbatches, link).step_ms
            fast_s = time.perf_counter() - start
            assert abs(ref - fast) < 1e-6 * ref, (kind, k, ref, fast)
            rows.append(f"| {k} | {kind.value} | {microbatches} | {ref_s:.2f} | {fast_s:.3f} | {ref:.1f} |")
    return rows


def planner_table(microbatches: int, batch: int) -> list[str]:
    shape = Shape(batch=batch // microbatches, seq=512, dim=4096, vocab=32000, dtype_bytes=2)
    nodes = transformer_costs(96, nodes_per_layer=40, shape=shape)
    nodes = tuple(
        dataclasses.replace(n, forward_ms=n.forward_ms / SPEEDUP, backward_ms=n.backward_ms / SPEEDUP)
        for n in nodes
    )
    work = workload(nodes)
    rows = [
        f"Model: {work.units} units, {sum(work.param_bytes) / 1e9:.1f} GB of parameters, "
        f"{work.compute_ms:.0f} ms forward + backward per microbatch of {shape.batch} on one device.",
        "",
        "| devices | planning s | best D × K | step ms | efficiency | runner-up | evaluated | skipped |",
        "|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for n in DEVICES:
        start = time.perf_counter()
        plan = plan_hybrid(
            work, devices=n, microbatches=microbatches, batch_size=batch,
            schedule=ScheduleKind.ONE_F_ONE_B, link=NETWORK, allreduce=NETWORK, memory_bytes=MEMORY,
        )
        seconds = time.perf_counter() - start
        best = plan.best
        second = (
            f"{plan.candidates[1].replicas} × {plan.candidates[1].stages} "
            f"({plan.candidates[1].step_ms:.0f} ms)" if len(plan.candidates) > 1 else "—"
        )
        rows.append(
            f"| {n} | {seconds:.2f} | {best.replicas} × {best.stages} | {best.step_ms:.0f} | "
            f"{best.efficiency:.2f} | {second} | {len(plan.candidates)} | {len(plan.skipped)} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--sim-microbatches", type=int, default=64)
    args = parser.parse_args()
    print("\n".join(simulator_table(args.sim_microbatches)))
    print()
    print("\n".join(planner_table(args.microbatches, args.batch)))


if __name__ == "__main__":
    main()
