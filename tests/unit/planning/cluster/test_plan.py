"""Clusters from text, plan_cluster on a small Llama, JSON round-trip, refusal with the fix."""

from __future__ import annotations

import pytest
import torch

import pipecut
from pipecut import Plan, summary
from pipecut.core.kinds import DataParallelKind, FrameworkKind
from pipecut.errors import InputError
from pipecut.options import DataParallelOptions
from pipecut.planning.cluster.figures import parse_cluster
from pipecut.planning.cluster.plan import plan_cluster
from tests.unit.tiny import tiny_llama


def test_plan_cluster_records_cluster_placement_and_run_and_round_trips() -> None:
    model, batch = tiny_llama()
    plan = plan_cluster(model, batch, "2x2xH100-SXM", microbatches=2)
    assert plan.cluster == parse_cluster("2x2xH100-SXM") and plan.placement is not None and plan.run is not None
    d, k = plan.placement.replicas, plan.placement.stages
    assert d * k == 4 and plan.num_stages == k and plan.batch_size == 8 // d
    assert sorted(plan.placement.grid()) == sorted((r, s) for r in range(d) for s in range(k))
    assert plan.run.tokens_per_s_per_gpu > 0 and 0 < plan.run.mfu < 1 and plan.run.peak_memory_bytes > 0
    # one KV head: no tensor-parallel size but 1 splits it
    assert plan.placement.tensor_parallel == 1 and any("context and expert parallelism are not planned" in n for n in plan.run.notes)
    chosen = [c for c in plan.replica_candidates if c.note == "chosen"]
    assert len(chosen) == 1 and chosen[0].layout is plan.placement.layout
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.run == plan.run and again.placement == plan.placement
    text = summary(plan)
    assert "cluster 2x2xH100-SXM" in text and "tokens/s per GPU" in text and "MFU" in text


def test_old_plans_read_without_cluster_fields() -> None:
    model, batch = tiny_llama()
    plan = plan_cluster(model, batch, "1x2xH100-SXM", microbatches=2)
    data = plan.to_dict()
    for key in ("cluster", "placement", "run"):
        data.pop(key)
    old = Plan.from_dict(data)
    assert old.cluster is None and old.run is None


def test_pipecut_plan_with_a_cluster_is_plan_cluster() -> None:

    model, batch = tiny_llama()
    via_plan = pipecut.plan(
        model, batch, cluster="1x2xH100-SXM", microbatches=2, schedule="1f1b",
        data_parallel=DataParallelOptions(kind=DataParallelKind.FSDP, replicas=2),
        partition=pipecut.PartitionOptions(recompute="full"),
    )
    direct = plan_cluster(model, batch, "1x2xH100-SXM", microbatches=2,
                          partition=pipecut.PartitionOptions(recompute="full"),
                          data_parallel=pipecut.DataParallelOptions(kind="fsdp", replicas=2))
    assert via_plan.run == direct.run and via_plan.placement == direct.placement
    assert via_plan.placement is not None and via_plan.placement.replicas == 2
    with pytest.raises(InputError, match="needs microbatches as a value"):
        pipecut.plan(model, batch, cluster="1x2xH100-SXM", microbatches="auto")


def test_parameters_are_counted_in_the_models_own_dtype() -> None:
    model, batch = tiny_llama()
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    for dtype in (torch.bfloat16, torch.float32):
        plan = plan_cluster(model.to(dtype), batch, "1x1xH100-SXM", partition=pipecut.PartitionOptions(recompute="none"))
        assert plan.run is not None
        tokens = plan.run.tokens_per_s_per_gpu
        flops = plan.run.mfu * plan.cluster.peak_flops / tokens  # per token
        attention = 12 * 2 * 64 * 16  # layers, hidden, sequence
        assert flops == pytest.approx(6 * params + attention)


def test_the_run_carries_its_range_and_the_parts_of_its_step_into_text_html_and_json() -> None:
    from pipecut.report.render import render_html

    model, batch = tiny_llama()
    plan = plan_cluster(model, batch, "2x2xH100-SXM", microbatches=2)
    r = plan.run
    assert r is not None and r.has_range and r.step_low_ms < r.step_ms < r.step_high_ms
    assert sum(p.ms for p in r.parts) == pytest.approx(r.step_ms)
    assert r.dominant == max(r.parts, key=lambda p: p.ms).name == r.parts[0].name
    assert {p.name for p in r.parts} <= {"compute", "recompute", "bubble"} | {
        f"link {link.name}" for link in (plan.cluster.intra, plan.cluster.inter)}
    assert Plan.from_json(plan.to_json()).run == r
    text = summary(plan)
    assert f"step {r.step_ms:.1f} ms ({r.step_low_ms:.1f}–{r.step_high_ms:.1f} ms), dominated by {r.dominant}" in text
    assert "step on the GPU that ends last: " + f"{r.parts[0].name} {r.parts[0].ms:.1f} ms" in text
    html = render_html(plan)
    assert f", dominated by {r.dominant}" in html and 'id="step-parts"' in html


def test_the_dominant_assumption_is_computed_from_the_step() -> None:
    model, batch = tiny_llama()
    # one microbatch through 4 stages: three quarters of the step is waiting
    deep = plan_cluster(model, batch, "1x4xH100-SXM", microbatches=1,
                        data_parallel=pipecut.DataParallelOptions(replicas=1),
                        partition=pipecut.PartitionOptions(recompute="none"))
    # four replicas of one stage: no bubble at all
    wide = plan_cluster(model, batch, "1x4xH100-SXM", microbatches=1,
                        data_parallel=pipecut.DataParallelOptions(replicas=4),
                        partition=pipecut.PartitionOptions(recompute="none"))
    assert deep.run is not None and wide.run is not None
    assert deep.run.dominant == "bubble"
    assert wide.run.dominant != "bubble" and "bubble" not in {p.name for p in wide.run.parts}


def test_a_plan_written_before_ranges_still_reads() -> None:
    model, batch = tiny_llama()
    data = plan_cluster(model, batch, "1x2xH100-SXM", microbatches=2).to_dict()
    for key in ("step_low_ms", "step_high_ms", "parts"):
        data["run"].pop(key)
    old = Plan.from_dict(data)
    assert old.run is not None and not old.run.has_range and old.run.dominant == ""
    assert "dominated by" not in summary(old)


def test_peak_memory_counts_the_state_of_its_kind_the_context_nccl_and_the_allocator() -> None:
    from pipecut.profile.hardware import memory_overheads
    from pipecut.report.text import human_bytes

    model, batch = tiny_llama()
    fsdp = plan_cluster(model, batch, "1x4xH100-SXM", microbatches=2,
                        data_parallel=pipecut.DataParallelOptions(kind="fsdp", replicas=4))
    ddp = plan_cluster(model, batch, "1x4xH100-SXM", microbatches=2,
                       data_parallel=pipecut.DataParallelOptions(kind="ddp", replicas=4))
    for plan in (fsdp, ddp):
        r = plan.run
        assert r is not None
        parts = {p.name.split(" (")[0]: p.nbytes for p in r.memory_parts}
        assert sum(parts.values()) == pytest.approx(r.peak_memory_bytes, abs=4)
        fixed = memory_overheads(1.0)
        assert parts["CUDA context and NCCL buffers"] == pytest.approx(fixed["context"] + fixed["nccl"], abs=1)
        tensors = parts["parameters, gradients and AdamW state"] + parts["activations"]
        assert parts["allocator reserve"] == pytest.approx(tensors * fixed["fragmentation"], abs=2)
        assert plan.stages[0].peak_memory_bytes == r.peak_memory_bytes  # the stage table shows the same
        assert "peak memory counts: parameters, gradients and AdamW state" in summary(plan)
        assert plan.cluster is not None and plan.memory_headroom_bytes == plan.cluster.memory_bytes - r.peak_memory_bytes > 0
        assert f"headroom {human_bytes(plan.memory_headroom_bytes)}" in summary(plan)
    state = {kind: next(p for p in plan.run.memory_parts if p.name.startswith("parameters"))
             for kind, plan in (("fsdp", fsdp), ("ddp", ddp)) if plan.run is not None}
    assert "sharded over 4" in state["fsdp"].name and "whole on each of 4" in state["ddp"].name
    assert state["ddp"].nbytes > state["fsdp"].nbytes
    assert any("ZeRO-2" in n and "not planned" in n for n in fsdp.run.notes if fsdp.run is not None)


def test_plan_cluster_weighs_every_engine_unless_one_is_asked() -> None:
    model, batch = tiny_llama()
    auto = plan_cluster(model, batch, "1x2xH100-SXM", microbatches=2, data_parallel=pipecut.DataParallelOptions(replicas=2))
    assert auto.run is not None and auto.run.sharding in ("ddp", "zero1", "fsdp")
    for kind in ("ddp", "zero1", "fsdp"):
        one = plan_cluster(model, batch, "1x2xH100-SXM", microbatches=2,
                           data_parallel=pipecut.DataParallelOptions(kind=kind, replicas=2))
        assert one.run is not None and one.run.sharding == kind
        assert one.data_parallel == DataParallelOptions(kind=kind, replicas=2)
        assert auto.run.step_ms <= one.run.step_ms


def test_a_cluster_plan_names_the_framework_it_prices_and_prices_its_kernels() -> None:
    """``measure=MeasureOptions(framework=...)``: the run priced as that framework runs it, named
    in the prediction and its notes; left out, pipecut's own runtime. The same through
    ``pipecut.plan(cluster=...)``, and a plan written before frameworks were named reads as
    pipecut's own."""
    model, batch = tiny_llama()
    ours = plan_cluster(model, batch, "1x2xH100-SXM", microbatches=2)
    megatron = plan_cluster(model, batch, "1x2xH100-SXM", microbatches=2,
                            measure=pipecut.MeasureOptions(framework="megatron"))
    assert ours.run is not None and megatron.run is not None
    assert ours.run.framework is FrameworkKind.PIPECUT and megatron.run.framework is FrameworkKind.MEGATRON
    assert megatron.run.compute_efficiency > ours.run.compute_efficiency  # Megatron's kernels' Hopper figure
    assert megatron.run.compute_ms < ours.run.compute_ms
    assert any(n.startswith("priced as megatron runs") for n in megatron.run.notes)
    via_plan = pipecut.plan(model, batch, cluster="1x2xH100-SXM", microbatches=2,
                            measure=pipecut.MeasureOptions(framework=FrameworkKind.MEGATRON))
    assert via_plan.run == megatron.run
    assert Plan.from_json(megatron.to_json()).run == megatron.run
    data = ours.to_dict()
    data["run"].pop("framework")
    assert Plan.from_dict(data).run == ours.run
    with pytest.raises(InputError, match="unknown framework 'deepspeed'"):
        pipecut.MeasureOptions(framework="deepspeed")
    with pytest.raises(InputError, match="framework 'torchtitan-compile-float8' runs compiled-float8 kernels"):
        plan_cluster(model, batch, "1x2xA100-80GB", microbatches=2,
                     measure=pipecut.MeasureOptions(framework="torchtitan-compile-float8"))
