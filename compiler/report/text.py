"""Plain-text views of a plan: the summary table printed by ``pipecut.summary(plan)``."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

__all__ = ["dominated_by", "human_bytes", "sequential_note", "step_range", "summary", "tensor_groups"]

if TYPE_CHECKING:
    from pipecut.cluster import ClusterPlacement, RunPrediction
    from pipecut.ir import Plan, ReplicaCandidate


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _asked(options: Any) -> str:
    """The options that differ from their defaults: ``microbatches=...``, ``schedule=...``,
    then ``group.field=value`` in group order."""
    out = []
    for name in ("microbatches", "schedule"):
        value = getattr(options, name)
        if value is not None:
            out.append(f"{name}={value.value if isinstance(value, enum.Enum) else value!r}")
    for group in options.GROUPS:
        given, default = getattr(options, group), type(getattr(options, group))()
        for f in dataclasses.fields(given):
            value = getattr(given, f.name)
            if value != getattr(default, f.name):
                shown = value.value if isinstance(value, enum.Enum) else value
                out.append(f"{group}.{f.name}={shown!r}")
    return ", ".join(out)


def summary(plan: Plan) -> str:
    header = ("stage", "device", "nodes", "params", "fwd ms", "bwd ms", "comm ms", "total ms",
              "memory", "send", "recv", "recompute")
    rows = [header]
    for s in plan.stages:
        rows.append((
            str(s.index), s.device, str(len(s.nodes)), human_bytes(s.param_bytes),
            f"{s.forward_ms:.3f}", f"{s.backward_ms:.3f}", f"{s.comm_ms:.3f}", f"{s.time_ms:.3f}",
            human_bytes(s.peak_memory_bytes), human_bytes(s.send_bytes), human_bytes(s.recv_bytes),
            s.recompute.value,
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    p = plan.predicted
    speedup = p.single_device_ms / p.step_ms if p.step_ms else float("nan")
    lines.append(
        f"schedule {plan.schedule.value}, {plan.microbatches} microbatches of "
        f"{plan.batch_size // plan.microbatches}; predicted step {p.step_ms:.2f} ms "
        f"(one device {p.single_device_ms:.2f} ms, {speedup:.2f}x), bubble "
        f"{p.bubble_fraction:.1%}, bottleneck stage {p.bottleneck_stage}; "
        f"{plan.solver.method.value} solved in {plan.solver.solve_ms:.1f} ms"
    )
    lines += _chosen(plan)
    if plan.options is not None and (asked := _asked(plan.options)):
        lines.append(f"asked: {asked}")
    if plan.solver.method.value == "given" and p.optimum_step_ms:  # no import: plan imports us
        lines.append(
            f"split given ({plan.solver.detail.removeprefix('split given: ')}): pipecut's own "
            f"split is predicted at {p.optimum_step_ms:.2f} ms ({p.optimum_step_ms / p.step_ms - 1:+.1%})"
        )
    if plan.data_parallel is not None:
        dp = plan.data_parallel
        lines.append(
            f"data parallel: {dp.replicas} replicas x {plan.num_ranks} ranks ({dp.resolved_kind.value}), "
            f"global batch {plan.batch_size * dp.resolved_replicas}"
        )
    if plan.cluster is not None and plan.run is not None:
        lines += _cluster_lines(plan)
    if plan.replica_candidates:
        weighed = "replicas x stages x tensor parallel" if any(c.tensor_parallel > 1 for c in plan.replica_candidates) \
            else "replicas x stages"
        lines.append(f"{weighed} weighed (data_parallel='auto'):")
        lines += [f"  {_replica_row(c)}" for c in plan.replica_candidates]
    if plan.tied:
        lines.append("tied parameters: " + ", ".join(f"{t.fqn} on stages {list(t.stages)}" for t in plan.tied))
    return "\n".join(lines)


def sequential_note(plan: Plan) -> str:
    """Why ``plan`` does not pipeline, or "" when it does."""
    if plan.microbatches > 1 or plan.num_ranks < 2:
        return ""
    return (f"1 microbatch on {plan.num_ranks} ranks: the stages run one after another (no "
            f"pipelining, {plan.num_ranks} devices doing the work of one); give microbatches > 1 "
            f"or leave microbatches out to let the planner choose")


def _chosen(plan: Plan) -> list[str]:
    """What the planner chose when asked to ("auto", the default) and why."""
    lines = []
    weighed = [c for c in plan.candidates if c.step_ms is not None]
    if weighed:
        marked = [c for c in weighed if c.note == "chosen"]  # a tie broken by preference
        best = marked[0] if marked else min(weighed, key=lambda c: c.step_ms or 0.0)
        others = sorted((c for c in weighed if c is not best), key=lambda c: c.step_ms or 0.0)[:3]
        runner_up = ", ".join(f"{c.microbatches} x {c.schedule.value} {c.step_ms:.2f} ms" for c in others)
        lines.append(
            f"chosen by the planner: {plan.microbatches} microbatches, {plan.schedule.value} "
            f"(lowest predicted step of {len(weighed)} pairs weighed"
            + (f"; next: {runner_up}" if runner_up else "") + ")"
        )
    lines += _ruled_out(plan)
    note = sequential_note(plan)
    return lines + ([f"warning: {note}"] if note else [])


def _ruled_out(plan: Plan) -> list[str]:
    """The candidates the planner could not weigh, grouped by reason: ``8 x gpipe/1f1b: why``."""
    by_note: dict[str, dict[int, list[str]]] = {}
    for c in plan.candidates:
        if c.step_ms is None:
            by_note.setdefault(c.note, {}).setdefault(c.microbatches, []).append(c.schedule.value)
    if not by_note:
        return []
    count = sum(len(kinds) for pairs in by_note.values() for kinds in pairs.values())
    lines = [f"ruled out ({count} of {len(plan.candidates)} pairs):"]
    for note, pairs in by_note.items():
        shown = ", ".join(f"{m} x {'/'.join(kinds)}" for m, kinds in sorted(pairs.items()))
        lines.append(f"  {shown}: {note}")
    return lines


def _replica_row(c: ReplicaCandidate) -> str:
    shape = "/".join(map(str, c.per_stage)) if c.per_stage else str(c.replicas)
    step = f"{c.step_ms:.2f} ms" if c.step_ms is not None else "-"
    layout = f" {c.layout.value}" if c.layout is not None else ""
    tp = f" x {c.tensor_parallel}" if c.tensor_parallel > 1 else ""
    return f"{shape} x {c.stages}{tp}{layout}: {step}" + (f"  ({c.note})" if c.note else "")


def tensor_groups(place: ClusterPlacement, shown: int = 8) -> str:
    """``GPUs 0-7 (r0 s0), 8-15 (r0 s1), … (64 groups)``: which GPUs form each tensor group."""
    grid = place.grid()
    groups = place.tensor_groups()
    text = ", ".join(f"{g[0]}-{g[-1]} (r{grid[g[0]][0]} s{grid[g[0]][1]})" for g in groups[:shown])
    return f"GPUs {text}" + (f", … ({len(groups)} groups)" if len(groups) > shown else "")


def _headroom(left: int, capacity: int) -> str:
    """The room a run leaves on its fullest GPU, or how far it is over."""
    if left < 0:
        return f"over by {human_bytes(-left)}: does not fit"
    return f"headroom {human_bytes(left)}, {left / capacity:.0%}"


def step_range(r: RunPrediction) -> str:
    """`` (5100.2–6001.0 ms)``: the step with the figures at either end of their range, or ""."""
    return f" ({r.step_low_ms:.1f}–{r.step_high_ms:.1f} ms)" if r.has_range else ""


def dominated_by(r: RunPrediction) -> str:
    """``, dominated by compute`` (the step's largest part), or ""."""
    return f", dominated by {r.dominant}" if r.dominant else ""


def _cluster_lines(plan: Plan) -> list[str]:
    c, r, place = plan.cluster, plan.run, plan.placement
    assert c is not None and r is not None
    where = (f"{place.replicas} replicas x {place.stages} stages"
             + (f" x tensor parallel {place.tensor_parallel}" if place.tensor_parallel > 1 else "")
             + f", {place.layout.value}" if place is not None else "")
    chunks = f" on {plan.stages_per_rank} stages per GPU" if plan.stages_per_rank > 1 else ""
    lines = [
        f"cluster {c.spec}: {c.gpus} GPUs, intra-node {c.intra.name}, inter-node {c.inter.name}; {where}",
        f"run as {r.framework.value} runs it ({r.sharding}, recompute {r.recompute}, {plan.schedule.value}{chunks}): "
        f"step {r.step_ms:.1f} ms"
        f"{step_range(r)}{dominated_by(r)}, bubble "
        f"{r.bubble_fraction:.1%}, {r.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {r.mfu:.1%}, "
        f"peak memory {human_bytes(r.peak_memory_bytes)} per GPU of {human_bytes(c.memory_bytes)} "
        f"({_headroom(c.memory_bytes - r.peak_memory_bytes, c.memory_bytes)}); "
        f"exposed collectives {r.exposed_comm_ms:.1f} ms",
    ]
    if place is not None and place.tensor_parallel > 1:
        lines.append(f"  tensor-parallel groups ({'sequence parallel, ' if r.sequence_parallel else ''}"
                     f"{c.intra.name}): {tensor_groups(place)}")
    if r.memory_parts:
        lines.append("  peak memory counts: " + ", ".join(
            f"{p.name} {human_bytes(p.nbytes)}" for p in r.memory_parts))
    if r.parts:
        lines.append("  step on the GPU that ends last: " + ", ".join(
            f"{p.name} {p.ms:.1f} ms ({p.ms / r.step_ms:.0%})" for p in r.parts))
    if plan.stages_per_rank > 1:  # the stage table's memory is each stage's share of its GPU's peak
        lines.append("  memory per GPU: " + ", ".join(
            f"rank {k} (stages {', '.join(map(str, plan.stages_on(k)))}) "
            f"{human_bytes(sum(plan.stages[s].peak_memory_bytes for s in plan.stages_on(k)))}"
            for k in range(plan.num_ranks)))
    lines += [f"  note: {n}" for n in r.notes]
    return lines
