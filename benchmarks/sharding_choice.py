"""What the replicas' engine and the training framework change in the cluster planner's choice:
Llama-3.1 8B, 70B and 405B.

    .venv/bin/python benchmarks/sharding_choice.py [--sizes 8b 70b 405b] [--shardings fsdp auto]
        [--frameworks pipecut megatron] [--recompute selective|full|none] [--out benchmarks/sharding_choice.json]

Each model (``examples/llama_meta.py``, built on meta) is planned for its cluster with
``plan_cluster(..., tensor_parallel="auto", schedule="1f1b")`` twice: with
``sharding="fsdp"`` (the planner's only sharded engine, and its default, before ZeRO-1) and
with ``sharding="auto"`` (DDP, ZeRO-1 and FSDP2 weighed, the fastest run that fits kept). The
table gives both choices: D × T × K, the engine, the predicted step, tokens/s per GPU, MFU and the
peak memory per GPU. ``--frameworks`` prices each run as that framework runs it
(``MeasureOptions(framework=...)``, ``compiler/frameworks.json``: its kernels' figure, its
ZeRO-1, the communication it overlaps); pipecut's own runtime by default. ``--recompute``: every
stage's activation checkpointing (default: the cluster plan's, selective). A prediction of
pipecut's cost model, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pipecut

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # examples.llama_meta

__all__ = ["CASES", "main"]

CASES = {
    "8b": {"cluster": "8x8xH100-SXM", "batch": 64, "microbatches": 1},
    "70b": {"cluster": "32x8xH100-SXM", "batch": 256, "microbatches": 8},
    "405b": {"cluster": "64x8xH100-SXM", "batch": 256, "microbatches": 32},
}
"""Per size: the cluster, the global batch (sequences of 8,192 tokens) and the microbatches."""


def choice(size: str, sharding: str, framework: str = "pipecut",
           recompute: str | None = None) -> dict[str, object]:  # pragma: no cover
    from examples.llama_meta import build
    from pipecut.planning.cluster.plan import plan_cluster

    case = CASES[size]
    model, inputs, loss_fn, target = build(size, batch_size=int(case["batch"]))
    start = time.perf_counter()
    plan = plan_cluster(model, inputs, str(case["cluster"]), microbatches=int(case["microbatches"]),
                        schedule="1f1b",
                        data_parallel=pipecut.DataParallelOptions(kind=sharding), loss_fn=loss_fn, target=target,
                        measure=pipecut.MeasureOptions(framework=framework),
                        partition=None if recompute is None else pipecut.PartitionOptions(recompute=recompute))
    run, place = plan.run, plan.placement
    assert run is not None and place is not None
    return {"size": size, "asked": sharding, "framework": run.framework.value, **case, "engine": run.sharding,
            "recompute": run.recompute,
            "replicas": place.replicas, "tensor_parallel": place.tensor_parallel, "stages": plan.num_stages,
            "step_ms": round(run.step_ms, 1), "tokens_per_s_per_gpu": round(run.tokens_per_s_per_gpu, 1),
            "mfu": round(run.mfu, 4), "peak_gib": round(run.peak_memory_bytes / 2**30, 2),
            "plan_s": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:  # pragma: no cover
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--shardings", nargs="+", default=["fsdp", "auto"], choices=["ddp", "zero1", "fsdp", "auto"])
    ap.add_argument("--frameworks", nargs="+", default=["pipecut"])
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default=None)
    ap.add_argument("--out", default=str(Path(__file__).with_name("sharding_choice.json")))
    args = ap.parse_args(argv)
    rows = []
    print(f"{'model':6} {'cluster':14} {'framework':10} {'asked':6} {'engine':6} {'D x T x K':>11} {'step ms':>9} "
          f"{'tok/s/GPU':>9} {'MFU':>6} {'GiB':>6}")
    for size in args.sizes:
        for framework, sharding in ((f, s) for f in args.frameworks for s in args.shardings):
            try:
                r = choice(size, sharding, framework, args.recompute)
            except pipecut.PartitionError as e:  # a refusal is a result: kept with its reason
                rows.append({"size": size, "asked": sharding, "framework": framework, **CASES[size],
                             "recompute": args.recompute, "refused": str(e)})  # None: the cluster plan's default
                Path(args.out).write_text(json.dumps({"rows": rows}, indent=2, sort_keys=True) + "\n")
                print(f"{size:6} {CASES[size]['cluster']:14} {framework:10} {sharding:6} refused: {e}", flush=True)
                continue
            rows.append(r)
            Path(args.out).write_text(json.dumps({"rows": rows}, indent=2, sort_keys=True) + "\n")  # kept if stopped
            shape = f"{r['replicas']}x{r['tensor_parallel']}x{r['stages']}"
            print(f"{size:6} {r['cluster']:14} {framework:10} {sharding:6} {r['engine']:6} {shape:>11} {r['step_ms']:9.1f} "
                  f"{r['tokens_per_s_per_gpu']:9.1f} {r['mfu']:6.1%} {r['peak_gib']:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
