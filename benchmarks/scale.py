"""Simulated scale: the schedule simulator and the D × K planner on 64 to 1,024 devices.

    .venv/bin/python benchmarks/scale.py            # both tables, markdown on stdout

1. Simulator: ``schedules.simulate.simulate`` (the one simulator: event driven, O(actions)) on K
   stages of 1 ms forward, 2 ms backward and 0.1 ms links, M microbatches: GPipe and 1F1B on
   K ranks, interleaved 1F1B on K/2 ranks of 2 stages each (M rounded up to a multiple of
   the ranks, as it needs); the time to build the schedule
   (``schedules.standard.build``; zero bubble list-schedules on the costs, with the backward
   split into 1 ms I and 1 ms W) and to simulate it. GPipe's step must equal its closed form
   (K − 1)(f + l) + M (f + b) + (K − 1)(b + l).
2. Planner: ``passes.hybrid.plan_hybrid`` on a synthetic 96-layer transformer
   (``benchmarks.synthetic.transformer_costs``; 3,751 units, 39 GB of BF16 parameters, microbatch of
   16 sequences of 512 tokens, width 4096) for N devices of 80 GB, global batch 1,024 in 64
   microbatches, 1F1B, 25 GB/s and 10 µs per message between stages and in the all-reduce
   ring (one InfiniBand HDR port per GPU). The synthetic times model a 50 GFLOP/s CPU; they are
   divided by 3,000 (matrix products at 150 TFLOP/s, about half an A100's BF16 peak).
3. Replication: uniform D × K (``plan_hybrid``) against per-stage replica counts
   (``passes.replication.plan_replicated``, PipeDream's DP) on the same cost model: the synthetic
   transformer above (with and without the 80 GB limit), and the profiled cost table of ``examples/gpt.py`` (batch 64 in 8
   microbatches of 8, 1F1B, 1 GB/s and 50 µs per message, unlimited memory).
Times are wall-clock on this machine (2 shared cores); predictions are the planner's model.

    .venv/bin/python benchmarks/scale.py --table replication   # only the third table
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, examples/

import pipecut
from benchmarks.synthetic import Shape, transformer_costs
from pipecut.cluster import Link
from pipecut.core.kinds import ScheduleKind
from pipecut.passes.costs.workload import Workload
from pipecut.passes.parallel.hybrid import ShapeChoice, plan_hybrid, workload
from pipecut.passes.parallel.replication import ReplicationKind
from pipecut.schedules.simulate import StageCosts, simulate
from pipecut.schedules.standard import build

DEVICES = (64, 128, 256, 512, 1024)
SPEEDUP = 3000.0
NETWORK = Link(bandwidth_bytes_per_ms=25e6, latency_ms=0.01)
MEMORY = 80 * 10**9


def simulator_table(microbatches: int) -> list[str]:
    rows = [
        "| stages | ranks | schedule | M | actions | build s | simulate s | step ms |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for k in DEVICES:
        f, b, w, link = [1.0] * k, [2.0] * k, [1.0] * k, [0.1] * (k - 1)
        costs = StageCosts(forward=tuple(f), backward=tuple(b), weight=tuple(w),
                           forward_link=tuple(link), backward_link=tuple(link))
        for kind, chunks in ((ScheduleKind.GPIPE, 1), (ScheduleKind.ONE_F_ONE_B, 1),
                             (ScheduleKind.INTERLEAVED_1F1B, 2), (ScheduleKind.ZERO_BUBBLE, 1)):
            ranks = k // chunks
            m = microbatches if chunks == 1 else -(-microbatches // ranks) * ranks
            start = time.perf_counter()
            split = kind is ScheduleKind.ZERO_BUBBLE
            schedule = build(kind, ranks, m, chunks, costs if split else None)
            build_s = time.perf_counter() - start
            start = time.perf_counter()
            step = simulate(schedule, f, b, link, weight_ms=w if split else ())
            sim_s = time.perf_counter() - start
            if kind is ScheduleKind.GPIPE:
                closed = (k - 1) * (1.0 + 0.1) + m * 3.0 + (k - 1) * (2.0 + 0.1)
                assert abs(step - closed) < 1e-6 * closed, (k, step, closed)
            actions = sum(len(r) for r in schedule)
            rows.append(f"| {k} | {ranks} | {kind.value} | {m} | {actions} | {build_s:.2f} | "
                        f"{sim_s:.3f} | {step:.1f} |")
    return rows


def synthetic(microbatches: int, batch: int) -> tuple[Workload, Shape]:
    shape = Shape(batch=batch // microbatches, seq=512, dim=4096, vocab=32000, dtype_bytes=2)
    nodes = transformer_costs(96, nodes_per_layer=40, shape=shape)
    nodes = tuple(
        dataclasses.replace(n, forward_ms=n.forward_ms / SPEEDUP, backward_ms=n.backward_ms / SPEEDUP)
        for n in nodes
    )
    return workload(nodes), shape


def planner_table(microbatches: int, batch: int) -> list[str]:
    work, shape = synthetic(microbatches, batch)
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


def _replicas(reps: tuple[int, ...]) -> str:
    """Run-length replica counts: (4, 4, 1) -> 4×2, 1."""
    runs: list[list[int]] = []
    for r in reps:
        if runs and runs[-1][0] == r:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    return ", ".join(f"{r}×{n}" if n > 1 else f"{r}" for r, n in runs)


def _compare(name: str, plan: ShapeChoice, seconds: float) -> str:
    uni, per = plan.best, plan.per_stage
    if per is None:
        return (
            f"| {name} | {plan.devices} | {uni.replicas} × {uni.stages} | {uni.step_ms:.1f} | "
            f"none: {plan.per_stage_reason} | | | | | {seconds:.1f} |"
        )
    return (
        f"| {name} | {plan.devices} | {uni.replicas} × {uni.stages} | {uni.step_ms:.1f} | "
        f"{per.stages} stages: {_replicas(per.per_stage)} | {per.bottleneck_ms:.2f} | {per.step_ms:.1f} | "
        f"{uni.step_ms / per.step_ms:.3f} | {per.efficiency:.2f} | {seconds:.1f} |"
    )


def replication_table(microbatches: int, batch: int) -> list[str]:
    rows = [
        "| model | devices | uniform D × K | uniform step ms | per-stage replicas (stage order) "
        "| per-stage bottleneck ms/mb | per-stage step ms | uniform / per-stage | per-stage efficiency | planning s |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    work, _ = synthetic(microbatches, batch)
    for memory, label in ((MEMORY, "synthetic, 80 GB"), (None, "synthetic, no limit")):
        for n in (64, 256, 1024):
            start = time.perf_counter()
            plan = plan_hybrid(
                work, devices=n, microbatches=microbatches, batch_size=batch,
                schedule=ScheduleKind.ONE_F_ONE_B, link=NETWORK, allreduce=NETWORK,
                memory_bytes=memory, replication=ReplicationKind.PER_STAGE,
            )
            rows.append(_compare(label, plan, time.perf_counter() - start))
    from examples import gpt

    model, inputs, loss_fn, target = gpt.build(batch_size=64)
    nodes = pipecut.plan(
        model, inputs, 1, loss_fn=loss_fn, target=target, microbatches=8,
        measure=pipecut.MeasureOptions(repeats=3, warmup=1),
    ).nodes
    slow = Link(bandwidth_bytes_per_ms=1e6, latency_ms=0.05)
    gpt_work = workload(nodes)
    for n in (4, 8, 16):
        start = time.perf_counter()
        plan = plan_hybrid(
            gpt_work, devices=n, microbatches=8, batch_size=64, schedule=ScheduleKind.ONE_F_ONE_B,
            link=slow, allreduce=slow, replication=ReplicationKind.PER_STAGE,
        )
        rows.append(_compare("examples/gpt", plan, time.perf_counter() - start))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--sim-microbatches", type=int, default=64)
    parser.add_argument("--table", choices=("all", "simulator", "planner", "replication"),
                        default="all")
    args = parser.parse_args()
    if args.table in ("all", "simulator"):
        print("\n".join(simulator_table(args.sim_microbatches)))
        print()
    if args.table in ("all", "planner"):
        print("\n".join(planner_table(args.microbatches, args.batch)))
        print()
    if args.table in ("all", "replication"):
        print("\n".join(replication_table(args.microbatches, args.batch)))


if __name__ == "__main__":
    main()
