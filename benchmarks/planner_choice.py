"""What the cluster planner chooses with the old costs and with the new (issue 29, item 6).

    .venv/bin/python benchmarks/planner_choice.py [--quick] [--out benchmarks/planner_choice.json]

**Old costs**: the roofline at one fitted efficiency per family (as at fb07911:
``FAMILY_EFFICIENCY`` 0.957 for ampere, 0.512 for hopper), links at their line rate with a flat
latency (10 µs in a node, 20 µs between nodes), per-GPU memory the tensors alone. **New costs**:
the per-op model of :mod:`pipecut.profile.hardware` (its residuals 0.666 / 0.441), NCCL's bus
bandwidth and latency per link, and the CUDA context, NCCL buffers and the allocator's reserve
in the memory and its fit check. Everything else is today's planner in both columns (every
schedule priced as it runs, cut values rebuilt where cheaper): the table isolates the costs.
The old costs are put back by patching three functions of :mod:`pipecut.planning.cluster.plan`
for the duration of one plan (:func:`old_costs`), nothing else.

Cases: the examples of ``docs/clusters.md`` and issue 29 (Llama-3.1-8B on meta, captured and
estimated: ``plan_cluster``), and every published run of ``validation_runs.json`` with its
global batch, microbatches, recompute and data-parallel kind, D × K, layout and stages per rank
left to the planner, once with the run's own schedule and once with ``schedule="auto"`` (each
model written as a cost table from its shapes, :func:`validation.transformer_rows`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pipecut

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # examples.llama_meta
import validation

OLD_EFFICIENCY = {"ampere": 0.957, "hopper": 0.512}
"""fb07911:compiler/planning/cluster/plan.py's FAMILY_EFFICIENCY."""

EXAMPLES = (
    # (name, cluster, global batch, microbatches, schedule, recompute)
    ("docs: 8B, 8x8xH100-SXM, -m 1, 1f1b", "8x8xH100-SXM", 64, 1, "1f1b", "selective"),
    ("issue 29: 8B, 2x8xH100-SXM, -m 8, 1f1b", "2x8xH100-SXM", 64, 8, "1f1b", "selective"),
    ("issue 29: 8B, 2x8xH100-SXM, -m 8, auto", "2x8xH100-SXM", 64, 8, "auto", "selective"),
    ("8B, 8x8xA100-80GB, -m 8, auto", "8x8xA100-80GB", 64, 8, "auto", "selective"),
)


@contextlib.contextmanager
def old_costs() -> Iterator[None]:
    """plan_cluster and parse_cluster with the old costs (see the module docstring)."""
    from pipecut.planning.cluster import figures, plan
    from pipecut.profile.devices import COMPUTE_EFFICIENCY

    def efficiency(profile: Any, framework_kind: Any = None) -> tuple[float, str]:
        value = OLD_EFFICIENCY.get(profile.family, COMPUTE_EFFICIENCY)
        return value, f"old costs: roofline at {value} of dense peak"

    with mock.patch.object(figures, "_has_figures", lambda profile: False), \
            mock.patch.object(figures, "family_efficiency", efficiency), \
            mock.patch.object(plan, "_overheads", lambda: {}):
        yield


def _choice(plan: Any) -> dict[str, Any]:
    r, place = plan.run, plan.placement
    return {"D": place.replicas, "K": place.stages, "layout": place.layout.value,
            "schedule": plan.schedule.value, "stages_per_rank": plan.stages_per_rank,
            "microbatches": plan.microbatches, "step_ms": round(r.step_ms, 1),
            "tokens_per_s_per_gpu": round(r.tokens_per_s_per_gpu), "peak_memory_gib": round(r.peak_memory_bytes / 2**30, 1)}


def examples() -> list[dict[str, Any]]:  # pragma: no cover
    from examples.llama_meta import build_8b
    from pipecut.planning.cluster.plan import plan_cluster

    out = []
    for name, cluster, batch, m, schedule, recompute in EXAMPLES:
        model, inputs, loss_fn, target = build_8b(batch_size=batch)
        row: dict[str, Any] = {"case": name}
        for label, ctx in (("old", old_costs()), ("new", contextlib.nullcontext())):
            t = time.perf_counter()
            with ctx:
                plan = plan_cluster(model, inputs, cluster, microbatches=m, schedule=schedule,
                                    partition=pipecut.PartitionOptions(recompute=recompute), loss_fn=loss_fn, target=target)
            row[label] = _choice(plan)
            print(f"  {name} [{label}] {row[label]} ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
        out.append(row)
    return out


def _published_choice(run: dict[str, Any], model: dict[str, Any], schedule: str, old: bool) -> dict[str, Any]:
    from pipecut.cluster import Link
    from pipecut.core.kinds import AttentionKernel, DataParallelKind, Recompute, ScheduleKind
    from pipecut.errors import PartitionError
    from pipecut.planning.cluster.choose import predict_run
    from pipecut.planning.cluster.figures import family_model, parse_cluster
    from pipecut.planning.cluster.plan import SCHEDULES, _overheads, model_flops_per_token
    from pipecut.planning.cluster.run import RunShape
    from pipecut.profile.devices import LINK_LATENCY_MS, Precision, device_profile, estimate_rows

    cluster = parse_cluster(run["cluster"])
    profile = device_profile(cluster.device)
    samples = run["microbatch_size"] * cluster.gpus // run["pp"]  # one microbatch of the global batch
    rows, work = validation.transformer_rows(
        model, samples=samples, seq=run["seq"], attention=run["attention"], dropout=run["framework"] == "megatron",
        loss_fp32=run["loss_fp32"], head_params=not model["tied"] or run["pp"] > 1)
    if old:
        nodes = estimate_rows(rows, work, profile, Precision.BF16, compute_efficiency=OLD_EFFICIENCY[profile.family])
        cluster = dataclasses.replace(
            cluster, intra=Link(name=cluster.intra.name, bandwidth_bytes_per_ms=profile.link_bytes_per_s / 1e3,
                                latency_ms=LINK_LATENCY_MS),
            inter=Link(name=cluster.inter.name, bandwidth_bytes_per_ms=profile.network_bytes_per_s / 1e3,
                       latency_ms=0.02))
        extra: dict[str, Any] = {}
    else:
        hw = family_model(profile, attention=AttentionKernel.FLASH if run["attention"] == "flash"
                          else AttentionKernel.EFFICIENT)
        assert hw is not None
        nodes = hw.price(rows, work)
        extra = _overheads()
    flops = model_flops_per_token(nodes, layers=model["layers"], hidden=model["hidden"], seq=run["seq"])
    kinds = SCHEDULES if schedule == "auto" else (ScheduleKind(schedule),)
    shape = RunShape(batch_size=samples * run["microbatches"], microbatches=run["microbatches"],
                     tokens_per_sample=run["seq"], model_flops_per_token=flops, schedule=kinds[0],
                     recompute=Recompute(run["recompute"]),
                     sharding=DataParallelKind.FSDP if run["dp"] == "fsdp" else DataParallelKind.DDP, **extra)
    try:
        best, _, _ = predict_run(nodes, cluster, shape, schedules=kinds)
    except PartitionError as e:  # nothing fits: a row of the table
        return {"refused": str(e).split(";")[0][:120]}
    return {"D": best.placement.replicas, "K": best.placement.stages, "layout": best.placement.layout.value,
            "schedule": best.schedule.value, "stages_per_rank": best.stages_per_rank,
            "microbatches": run["microbatches"], "step_ms": round(best.step_ms, 1),
            "tokens_per_s_per_gpu": round(best.tokens_per_s_per_gpu),
            "peak_memory_gib": round(best.peak_memory_bytes / 2**30, 1)}


def published(quick: bool) -> list[dict[str, Any]]:  # pragma: no cover
    data = validation.load()
    out = []
    for run in data["runs"][: 4 if quick else None]:
        for schedule in (run["schedule"], "auto"):
            t = time.perf_counter()
            row = {"case": f"{run['name']} ({run['cluster']}, published {run['dp']} D×K "
                           f"{data_shape(run)}, {run['schedule']}), schedule {schedule}",
                   "old": _published_choice(run, data["models"][run["model"]], schedule, old=True),
                   "new": _published_choice(run, data["models"][run["model"]], schedule, old=False)}
            print(f"  {row['case']}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
            out.append(row)
    return out


def data_shape(run: dict[str, Any]) -> str:
    from pipecut.planning.cluster.figures import parse_cluster

    return f"{parse_cluster(run['cluster']).gpus // run['pp']}×{run['pp']}"


def _short(c: dict[str, Any]) -> str:
    if "refused" in c:
        return f"refused: {c['refused']}"
    v = f" V{c['stages_per_rank']}" if c["stages_per_rank"] > 1 else ""
    return (f"{c['D']}×{c['K']} {c['layout'].split('_')[0]}, {c['schedule']}{v}, M {c['microbatches']}: "
            f"{c['step_ms']:.0f} ms, {c['peak_memory_gib']} GiB")


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("D", "K", "layout", "schedule", "stages_per_rank", "microbatches", "refused")
    return all(a.get(k) == b.get(k) for k in keys)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | old costs | new costs | changed |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {_short(r['old'])} | {_short(r['new'])} | "
                     f"{'' if _same(r['old'], r['new']) else '**yes**'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first 4 published runs, no captured examples")
    ap.add_argument("--out", default=str(Path(__file__).with_name("planner_choice.json")))
    args = ap.parse_args(argv)
    rows = ([] if args.quick else examples()) + published(args.quick)
    for r in rows:
        r["changed"] = not _same(r["old"], r["new"])
    print(markdown(rows))
    Path(args.out).write_text(json.dumps({"about": __doc__.split("\n\n")[2], "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
