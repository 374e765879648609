"""Benchmark: pipecut's partition against the splits of DeepSpeed, torchgpipe and by-hand tools.

    .venv/bin/python benchmarks/partition.py [--quick] [--out benchmarks/partition.json]
    .venv/bin/python benchmarks/partition.py --heavy [--out benchmarks/heavy.json]

(``.venv-newest/bin/python`` after ``make vision`` adds the torchvision models.) Every model is captured and profiled
once; each K then re-partitions the same cost table, so all methods are scored on identical
numbers by one cost model (compute / speed + communication of cut tensors, memory with the
schedule's inflight microbatches). Prints two markdown tables: the slowest stage per method
without a memory limit, and with a memory limit that needs recompute.

``--heavy``: 32k-vocabulary LMs whose head outweighs a stage's share at K = 4 and 8, the
slowest stage with the head whole and in row pieces (``pipecut.planning.heavy``), beside the bound
total / K; both tables share every untouched node's measured cost (see
:func:`benchmarks.heavy.heavy_rows`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipecut
from benchmarks.baselines import Baseline, baseline_bounds, layer_sums
from benchmarks.synthetic import transformer_costs
from pipecut.core.kinds import NodeOp, ScheduleKind
from pipecut.ir import DeviceSpec, NodeCost
from pipecut.passes.partition.memory_dp import lower_bound
from pipecut.passes.partition.memory_floor import min_peak_memory
from pipecut.passes.partition.memory_partition import partition_ilp
from pipecut.passes.partition.problem import evaluate, formulate
from pipecut.passes.partition.solve import DEFAULT_LINK, partition_costs

MICROBATCHES = 8
SCHEDULE = ScheduleKind.ONE_F_ONE_B


def _examples() -> dict[str, Callable[[], tuple]]:
    from examples import gpt, mlp, resnet

    return {"examples/mlp": mlp.build, "examples/gpt": gpt.build, "examples/resnet": resnet.build}


def _hf() -> dict[str, Callable[[], tuple]]:
    try:
        import transformers as tf
    except ImportError:
        return {}

    def gpt2(layers: int) -> Callable[[], tuple]:
        def build() -> tuple:
            cfg = tf.GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=2048,
                                n_positions=64, use_cache=False)
            torch.manual_seed(0)
            ids = torch.randint(0, 2048, (16, 64))
            return tf.GPT2LMHeadModel(cfg), {"input_ids": ids}, None, None
        return build

    def bert() -> tuple:
        cfg = tf.BertConfig(num_hidden_layers=12, hidden_size=128, num_attention_heads=4,
                            intermediate_size=512, vocab_size=2048, max_position_embeddings=64)
        torch.manual_seed(0)
        ids = torch.randint(0, 2048, (16, 64))
        return tf.BertForMaskedLM(cfg), {"input_ids": ids}, None, None

    return {"hf/gpt2-12L": gpt2(12), "hf/bert-12L": bert, "hf/gpt2-48L": gpt2(48)}


def _vision() -> dict[str, Callable[[], tuple]]:
    try:
        import torchvision.models as tvm
    except Exception:  # torchvision does not import beside torch 2.13 in the main venv
        return {}

    def model(fn: Callable[..., torch.nn.Module]) -> Callable[[], tuple]:
        def build() -> tuple:
            torch.manual_seed(0)
            x = torch.randn(16, 3, 64, 64)
            target = torch.randint(0, 10, (16,))
            return fn(num_classes=10), (x,), torch.nn.functional.cross_entropy, target
        return build

    return {"tv/resnet50": model(tvm.resnet50), "tv/mobilenet_v3_small": model(tvm.mobilenet_v3_small)}


def cost_table(build: Callable[[], tuple], repeats: int) -> tuple[tuple[NodeCost, ...], int, float]:
    model, inputs, loss_fn, target = build()
    start = time.perf_counter()
    plan = pipecut.plan(
        model, inputs, 1, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
        measure=pipecut.MeasureOptions(repeats=repeats, warmup=1),
    )
    return plan.nodes, plan.batch_size, time.perf_counter() - start


def row(name: str, nodes: tuple[NodeCost, ...], batch: int, k: int,
        memory: float | None) -> dict:
    specs = [DeviceSpec(name=f"d{i}", memory_bytes=None if memory is None else int(memory))
             for i in range(k)]
    start = time.perf_counter()
    plan = partition_costs(nodes, devices=specs, microbatches=MICROBATCHES, batch_size=batch,
                           schedule=SCHEDULE, link=DEFAULT_LINK)
    plan_ms = (time.perf_counter() - start) * 1e3
    form = formulate(nodes, devices=specs, link=DEFAULT_LINK, schedule=SCHEDULE,
                     microbatches=MICROBATCHES, recompute=memory is not None)
    prob = form.problem
    ilp = partition_ilp(prob, modules=form.modules, time_limit_s=30)
    params = [float(s) for s in prob.fixed_bytes]
    out = {
        "model": name, "units": prob.units, "k": k, "memory": memory,
        "pipecut": max(plan.predicted.stage_ms), "method": plan.solver.method.value,
        "plan_ms": plan_ms, "ilp": ilp.evaluation.bottleneck_ms, "ilp_optimal": ilp.optimal,
        "ilp_ms": ilp.solve_ms, "lower_bound": lower_bound(prob),
        "recomputed": sum(s.recompute.value == "full" for s in plan.stages),
    }
    for base, weights in ((Baseline.LAYERS, params), (Baseline.PARAMS, params),
                          (Baseline.TIME, list(prob.compute_ms))):
        bounds = baseline_bounds(form.modules, layer_sums(form.modules, weights), k, base)
        if bounds is None or len(set(bounds)) != k + 1:
            out[base.name.lower()] = None
            continue
        ev = evaluate(prob, bounds)
        out[base.name.lower()] = ev.bottleneck_ms if ev.fits else math.inf
    return out


def fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    return "OOM" if math.isinf(x) else f"{x:.1f}"


def table(rows: list[dict]) -> str:
    head = ("| model | units | K | pipecut | equal layers | equal params | block-time | "
            "lower bound | ILP optimum (proved) | gap to ILP | recomputed stages | plan ms |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        gap = (r["pipecut"] / r["ilp"] - 1) * 100
        lines.append(
            f"| {r['model']} | {r['units']} | {r['k']} | **{fmt(r['pipecut'])}** | "
            f"{fmt(r['layers'])} | {fmt(r['params'])} | {fmt(r['time'])} | "
            f"{fmt(r['lower_bound'])} | {fmt(r['ilp'])} ({'yes' if r['ilp_optimal'] else 'no'}) | "
            f"{gap:+.2f}% | {r['recomputed']}/{r['k']} | {r['plan_ms']:.0f} |"
        )
    return "\n".join(lines)


def parse_args(description: str, heavy: bool = False) -> argparse.Namespace:
    """The options the partition and ILP-solver benchmarks share (``heavy``: and the partition
    benchmark's ``--heavy``); sets their thread count."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="examples and the synthetic model only")
    ap.add_argument("--repeats", type=int, default=3, help="profiling repeats per node")
    ap.add_argument("--only", default="", help="only models whose name starts with this")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    if heavy:
        ap.add_argument("--heavy", action="store_true",
                        help="only the heavy-head section: LM heads whole and in row pieces")
    args = ap.parse_args()
    torch.set_num_threads(2)
    return args


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], heavy=True)
    if args.heavy:
        from benchmarks.heavy import heavy_main

        heavy_main(args.repeats, args.only, args.out)
        return
    builders = {**_examples(), **({} if args.quick else {**_hf(), **_vision()})}
    builders = {k: v for k, v in builders.items() if k.startswith(args.only)}
    tables: dict[str, tuple[tuple[NodeCost, ...], int]] = {}
    for name, build in builders.items():
        try:
            nodes, batch, secs = cost_table(build, args.repeats)
        except Exception as e:  # a model the capture cannot handle is reported, not fatal
            print(f"skip {name}: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        print(f"profiled {name}: {len(nodes)} nodes in {secs:.1f} s", file=sys.stderr)
        tables[name] = (nodes, batch)
    if "synthetic/transformer-48L".startswith(args.only):
        tables["synthetic/transformer-48L"] = (transformer_costs(48), 16)

    free, limited = [], []
    for name, (nodes, batch) in tables.items():
        units = sum(1 for n in nodes if n.op not in (NodeOp.PLACEHOLDER, NodeOp.GET_ATTR))
        for k in (2, 4, 8):
            if units >= 2 * k:
                free.append(row(name, nodes, batch, k, None))
        # a limit halfway between what fits with recompute and what fits without it
        specs = [DeviceSpec(name="d")] * 4
        need = {}
        for rc in (False, True):
            form = formulate(nodes, devices=specs, link=DEFAULT_LINK, schedule=SCHEDULE,
                             microbatches=MICROBATCHES, recompute=rc)
            need[rc] = min_peak_memory(form.problem)[0]
        if need[True] < 0.9 * need[False]:
            limited.append(row(name, nodes, batch, 4, (need[True] + need[False]) / 2))
        print(f"done {name}", file=sys.stderr)
    print("### Without a memory limit (1F1B, 8 microbatches; slowest stage, ms per microbatch)\n")
    print(table(free))
    print("\n### With a memory limit that needs recompute (K = 4, limit halfway between the least "
          "memory with and without recompute)\n")
    print(table(limited))
    print("\n| model | memory limit per device |\n|---|---|")
    for r in limited:
        print(f"| {r['model']} | {r['memory'] / 2**20:.1f} MiB |")
    if args.out:
        args.out.write_text(json.dumps({"free": free, "limited": limited}, indent=1))


if __name__ == "__main__":
    main()
