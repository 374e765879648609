"""Every schedule priced as it runs on a cluster (issue 29, item 5), and one prediction per plan
(item 7): the stage table of a cluster plan is the chosen run's.

The run model builds each schedule with the runtime's generators and times it with the one
simulator; these tests check that on constructed workloads (exact values where the schedule
fixes them) and on the Llama-3.1-8B example of the issue (meta device, estimated costs).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import pipecut
from benchmarks import activation_closed_form as acf
from pipecut import Plan, summary
from pipecut.cluster import Cluster, Layout, Link
from pipecut.core.kinds import Recompute, ScheduleKind
from pipecut.errors import InputError
from pipecut.passes.costs.workload import Workload
from pipecut.planning.cluster.plan import plan_cluster
from pipecut.planning.cluster.run import (
    RunCandidate,
    RunShape,
    block_of,
    choose_run,
    evaluate_run,
)
from pipecut.planning.cluster.schedule import chunk_options, peak_activations, weight_ms
from pipecut.report.gantt import predicted_spans
from pipecut.report.text import human_bytes
from pipecut.schedules.format import parse_schedule
from pipecut.schedules.simulate import StageCosts, simulate
from pipecut.schedules.standard import build

NVLINK = Link(name="nvlink", bandwidth_bytes_per_ms=4e8, latency_ms=0.01)
NET = Link(name="net", bandwidth_bytes_per_ms=5e7, latency_ms=0.02)


def cluster(nodes: int, per_node: int, memory: int = 10**12) -> Cluster:
    return Cluster(nodes=nodes, gpus_per_node=per_node, device="X", memory_bytes=memory,
                   peak_flops=1e15, intra=NVLINK, inter=NET)


def chain(units: int, *, params: int = 1000, cut: int = 0, act: int = 1000) -> Workload:
    """``units`` equal blocks ``layers.i``: forward 1 ms, backward 2 ms, every cut ``cut`` bytes."""
    return Workload(
        forward_ms=(1.0,) * units, backward_ms=(2.0,) * units, param_bytes=(params,) * units,
        activation_bytes=(act,) * units, cut_forward_bytes=(0, *([cut] * (units - 1)), 0),
        cut_backward_bytes=(0, *([cut] * (units - 1)), 0), modules=tuple(f"layers.{i}" for i in range(units)),
    )


def run(work: Workload, c: Cluster, d: int, k: int, kind: ScheduleKind, v: int | None = None,
        **kw) -> RunCandidate:
    shape = RunShape(batch_size=8, microbatches=8, tokens_per_sample=10, model_flops_per_token=1.0,
                     schedule=kind, stages_per_rank=v, **kw)
    out = evaluate_run(work, block_of(work.modules), shape, c, replicas=d, stages=k,
                       layout=Layout.STAGES_INSIDE_NODES)
    assert isinstance(out, RunCandidate), out
    return out


def test_on_one_cost_table_zero_bubble_and_interleaved_beat_1f1b_and_keep_more_memory() -> None:
    # 16 equal blocks on 4 GPUs, 8 microbatches: 1F1B's bubble is (K - 1) / (M + K - 1)
    work, c = chain(16), cluster(1, 4)
    one = run(work, c, 1, 4, ScheduleKind.ONE_F_ONE_B)
    zb = run(work, c, 1, 4, ScheduleKind.ZERO_BUBBLE)
    inter = run(work, c, 1, 4, ScheduleKind.INTERLEAVED_1F1B, 2)
    assert one.step_ms == pytest.approx((8 + 4 - 1) * (4 * 1.0 + 4 * 2.0))  # (M + K - 1)(F + B)
    assert zb.step_ms < one.step_ms and inter.step_ms < one.step_ms
    assert one.peak_memory_bytes <= inter.peak_memory_bytes and one.peak_memory_bytes <= zb.peak_memory_bytes
    assert one.peak_memory_bytes < inter.peak_memory_bytes  # interleaving's warm-up holds more
    # 1F1B: stage s holds K - s microbatches of 4 blocks' activations (1000 bytes each)
    state = one.rank_memory_bytes[3] - 1 * 4 * 1000
    assert one.rank_memory_bytes == tuple(state + (4 - s) * 4000 for s in range(4))
    assert (zb.schedule, inter.schedule, inter.stages_per_rank, len(inter.stages)) == (
        ScheduleKind.ZERO_BUBBLE, ScheduleKind.INTERLEAVED_1F1B, 2, 8)


def test_the_step_is_the_simulators_on_the_runtime_schedule() -> None:
    """One model of a schedule: the run's step is simulate() of build() on the run's own stage
    costs, split backward and links included."""
    work, c = chain(8, cut=10**6), cluster(2, 2)
    for kind, v in ((ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.ZERO_BUBBLE, 1),
                    (ScheduleKind.INTERLEAVED_1F1B, 2), (ScheduleKind.ZBV, 2), (ScheduleKind.GPIPE, 1)):
        r = run(work, c, 1, 4, kind, v)
        f = [st.forward_ms for st in r.stages]
        b = [st.backward_ms for st in r.stages]
        w = [st.weight_ms for st in r.stages]
        links = [0.0 if name == "same GPU" else (NET if name == "net" else NVLINK).latency_ms
                 + 10**6 / (NET if name == "net" else NVLINK).bandwidth_bytes_per_ms for name in r.cut_links]
        costs = StageCosts(forward=tuple(f), backward=tuple(b), weight=tuple(w), forward_link=tuple(links),
                           backward_link=tuple(links))
        assert r.step_ms == pytest.approx(simulate(build(kind, 4, 8, v, costs), f, b, links, links, w)), kind


def test_the_step_comes_apart_into_compute_links_and_the_bubble() -> None:
    """The parts of a step add up to it on the GPU that ends last; 1F1B on 4 equal stages with
    free cuts: compute M·(F + B) per GPU, the bubble (K − 1)(F + B); a slow cut shows as its link."""
    one = run(chain(16), cluster(1, 4), 1, 4, ScheduleKind.ONE_F_ONE_B)
    assert dict(one.parts) == pytest.approx({"compute": 8 * 12.0, "bubble": 3 * 12.0})
    assert one.parts[0][0] == "compute"
    slow = run(chain(16, cut=10**9), cluster(4, 1), 1, 4, ScheduleKind.ONE_F_ONE_B)
    parts = dict(slow.parts)
    assert sum(parts.values()) == pytest.approx(slow.step_ms)
    assert slow.parts[0][0] == "link net" and parts["link net"] > parts["compute"]


def test_memory_beyond_tensors_is_added_to_every_gpu_and_to_the_fit_check() -> None:
    work, c = chain(16), cluster(1, 4)
    bare = run(work, c, 1, 4, ScheduleKind.INTERLEAVED_1F1B, 2)
    full = run(work, c, 1, 4, ScheduleKind.INTERLEAVED_1F1B, 2, fixed_memory_bytes=10**6, reserve_fraction=0.1)
    assert full.rank_memory_bytes == pytest.approx([b * 1.1 + 10**6 for b in bare.rank_memory_bytes], abs=2)
    for r in range(4):  # a GPU's two stages still add up to its peak
        mine = [st.memory_bytes for s, st in enumerate(full.stages) if s % 4 == r]  # interleaved: stage s on rank s mod K
        assert sum(mine) == pytest.approx(full.rank_memory_bytes[r], abs=2)
    parts = dict(full.memory_parts)
    assert set(parts) == {"state", "activations", "CUDA context and NCCL buffers", "allocator reserve"}
    assert sum(parts.values()) == pytest.approx(full.peak_memory_bytes, abs=4)
    assert set(dict(bare.memory_parts)) == {"state", "activations"}
    # a GPU with room for the tensors but not for the overheads does not fit
    shape = RunShape(batch_size=8, microbatches=8, tokens_per_sample=10, model_flops_per_token=1.0,
                     fixed_memory_bytes=10**6)
    tight = cluster(1, 4, memory=bare.peak_memory_bytes + 10**5)
    assert choose_run(work, block_of(work.modules), dataclasses.replace(shape, fixed_memory_bytes=0), tight,
                      replicas=1).best is not None
    refused = choose_run(work, block_of(work.modules), shape, tight, replicas=1)
    assert refused.best is None and "needs" in refused.skipped[0].reason
    with pytest.raises(InputError, match=r"reserve_fraction=1\.5"):
        dataclasses.replace(shape, reserve_fraction=1.5)


def test_interleaving_crosses_more_cuts_and_zbv_turns_on_one_gpu() -> None:
    work, c = chain(16, cut=10**6), cluster(1, 4)
    inter = run(work, c, 1, 4, ScheduleKind.INTERLEAVED_1F1B, 4)
    assert len(inter.cut_links) == 4 * 4 - 1 and "same GPU" not in inter.cut_links  # V·K − 1 cuts
    zbv = run(work, c, 1, 4, ScheduleKind.ZBV)
    assert zbv.cut_links.count("same GPU") == 1 and len(zbv.cut_links) == 2 * 4 - 1  # the V's turn
    # more messages cost more: the same interleaving with free links is faster
    free = run(dataclasses.replace(work, cut_forward_bytes=(), cut_backward_bytes=()), c, 1, 4,
               ScheduleKind.INTERLEAVED_1F1B, 4)
    assert free.step_ms < inter.step_ms


def test_split_backward_keeps_recomputed_activations_until_the_weight_pass() -> None:
    work, c = chain(16, cut=100), cluster(1, 4)
    one = run(work, c, 1, 4, ScheduleKind.ONE_F_ONE_B, recompute=Recompute.FULL)
    zb = run(work, c, 1, 4, ScheduleKind.ZERO_BUBBLE, recompute=Recompute.FULL)
    plain = run(work, c, 1, 4, ScheduleKind.ZERO_BUBBLE)
    assert one.peak_memory_bytes < zb.peak_memory_bytes <= plain.peak_memory_bytes
    assert zb.stages[1].backward_ms == pytest.approx(4 * 2.0 + 4 * 1.0)  # the recompute, in the I pass
    assert zb.stages[1].weight_ms == pytest.approx(4 * 2.0 / 2)


def test_peak_activations_walks_each_ranks_actions() -> None:
    one_rank = parse_schedule("0F0 0I0 0F1 0W0 0I1 0W1")
    # F0: 10; I0 rebuilds 5 (kept to W); F1: 25 at the peak; W0 frees 15
    assert peak_activations(one_rank, [10.0], [5.0], [1.0]) == (25.0,)
    two_stages = parse_schedule("0F0 2F0 2B0 0F1 0B0 0B1")  # a rank holding stages 0 and 2 of 3
    # peak at 0B0: two microbatches of stage 0 kept and one block rebuilt; stage 2 holds none
    assert peak_activations(two_stages, [10.0, 0.0, 4.0], [0.0] * 3, [3.0, 0.0, 2.0]) == (23.0, 0.0, 0.0)
    assert peak_activations(two_stages, [10.0, 0.0, 15.0], [0.0] * 3, [3.0, 0.0, 2.0]) == (10.0, 0.0, 17.0)


def test_weight_pass_is_half_the_parameter_backward_and_all_of_it_on_the_first_stage() -> None:
    work = dataclasses.replace(chain(4, cut=100), param_bytes=(10, 0, 10, 10))
    assert weight_ms(work, 0, 2, 1) == pytest.approx(4.0)  # no gradient leaves: the whole backward
    assert weight_ms(work, 1, 4, 2) == pytest.approx((2.0 + 2.0) / 2 / 2)


def test_stages_per_rank_options() -> None:
    assert chunk_options(ScheduleKind.INTERLEAVED_1F1B, 2, 32) == (2, 4, 8, 16)
    assert chunk_options(ScheduleKind.INTERLEAVED_1F1B, 3, 32) == (2,)
    assert chunk_options(ScheduleKind.ZBV, 4, 32) == (2,) and chunk_options(ScheduleKind.GPIPE, 4, 32) == (1,)
    with pytest.raises(InputError, match="zero-bubble runs 1 stage"):
        RunShape(batch_size=1, microbatches=1, tokens_per_sample=1, model_flops_per_token=1.0,
                 schedule=ScheduleKind.ZERO_BUBBLE, stages_per_rank=2)


def test_auto_picks_the_fastest_schedule_that_fits() -> None:
    work = chain(16)
    shape = RunShape(batch_size=8, microbatches=8, tokens_per_sample=10, model_flops_per_token=1.0)
    every = tuple(ScheduleKind)
    roomy = choose_run(work, block_of(work.modules), shape, cluster(1, 4), replicas=1, schedules=every)
    assert roomy.best is not None and roomy.best.schedule is not ScheduleKind.ONE_F_ONE_B
    assert roomy.best.step_ms == min(c.step_ms for c in roomy.candidates)
    assert {c.schedule for c in roomy.candidates} == set(every)
    one = next(c for c in roomy.candidates if c.schedule is ScheduleKind.ONE_F_ONE_B)
    tight = choose_run(work, block_of(work.modules), shape, cluster(1, 4, memory=one.peak_memory_bytes),
                       replicas=1, schedules=every)
    assert tight.best is not None and tight.best.peak_memory_bytes <= one.peak_memory_bytes
    assert tight.best.step_ms >= roomy.best.step_ms
    assert any("needs" in s.reason for s in tight.skipped)


def _tiny_llama(layers: int = 4) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, use_cache=False)
    return LlamaForCausalLM(cfg).to(torch.bfloat16), {"input_ids": torch.zeros(8, 128, dtype=torch.long)}


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_a_cluster_plan_with_virtual_stages_is_the_runs(schedule: str) -> None:
    model, batch = _tiny_llama()
    plan = plan_cluster(model, batch, "1x4xH100-SXM", microbatches=4, schedule=schedule,
                        data_parallel=pipecut.DataParallelOptions(replicas=1))
    assert plan.run is not None and plan.placement is not None
    assert plan.schedule.value == schedule and plan.stages_per_rank == 2 and plan.num_ranks == 4
    per_gpu = [sum(plan.stages[s].peak_memory_bytes for s in plan.stages_on(r)) for r in range(4)]
    assert max(per_gpu) == plan.run.peak_memory_bytes
    assert plan.predicted.step_ms == plan.run.step_ms
    # the Gantt chart is the run's pipeline (one replica: no collective after it)
    assert max(s.end for s in predicted_spans(plan)) == pytest.approx(plan.run.step_ms, rel=1e-9)
    assert Plan.from_json(plan.to_json()) == plan
    assert "stages per GPU" in summary(plan)


def test_pipecut_plan_weighs_every_schedule_for_a_cluster() -> None:
    model, batch = _tiny_llama()
    plan = pipecut.plan(model, batch, cluster="1x4xH100-SXM", microbatches=4, schedule="auto")
    assert {c.schedule for c in plan.candidates} == set(ScheduleKind)
    chosen = [c for c in plan.candidates if c.note == "chosen"]
    assert len(chosen) == 1 and chosen[0].schedule is plan.schedule
    assert chosen[0].step_ms == min(c.step_ms for c in plan.candidates if c.step_ms is not None)


@pytest.mark.timeout(900)
def test_the_stage_table_is_the_run_line_on_llama_8b() -> None:
    """Issue 29's example: Llama-3.1-8B, batch 64, 2x8 H100, selective recompute, M = 8. The
    stage table said recompute none and 79.0 GiB on stage 0 while the run line said selective
    and 58.9 GiB per GPU; now both are the chosen run."""
    from examples.llama_meta import build_8b

    model, inputs, loss_fn, target = build_8b(batch_size=64)
    plan = plan_cluster(model, inputs, "2x8xH100-SXM", microbatches=8,
                        partition=pipecut.PartitionOptions(recompute="selective"), loss_fn=loss_fn, target=target)
    assert plan.run is not None and plan.cluster is not None and plan.run.recompute == "selective"
    capacity = plan.cluster.memory_bytes
    assert plan.run.peak_memory_bytes <= capacity
    assert all(s.peak_memory_bytes <= capacity for s in plan.stages)
    assert max(s.peak_memory_bytes for s in plan.stages) == plan.run.peak_memory_bytes
    assert {s.recompute for s in plan.stages} == {Recompute.SELECTIVE}
    text = summary(plan)
    table = text.split("\nschedule ")[0].splitlines()[2:]  # the stage rows
    peak = human_bytes(plan.run.peak_memory_bytes)
    assert len(table) == plan.num_stages and all(row.split()[-1] == "selective" for row in table)
    assert any(f"  {peak}  " in row for row in table)
    assert "run as pipecut runs it (fsdp, recompute selective, 1f1b)" in text and f"peak memory {peak} per GPU" in text


def test_a_plan_whose_cuts_cross_both_links_says_which_one_it_draws() -> None:
    model, batch = _tiny_llama()
    plan = plan_cluster(model, batch, "2x2xH100-SXM", microbatches=4, data_parallel=pipecut.DataParallelOptions(replicas=1))
    assert plan.run is not None and plan.cluster is not None and plan.num_stages == 4
    assert plan.link.bandwidth_bytes_per_ms == plan.cluster.inter.bandwidth_bytes_per_ms
    assert any("1 of the 3 cuts cross nodes" in n for n in plan.run.notes)


# Activation memory against Korthikanti et al. 2022's closed form (docs/clusters.md, "Activation
# memory against the closed form"; benchmarks/activation_closed_form.py runs the 8B grid). At these
# shapes a·s/h = 8, as at 8B's width with s = 1024; the closed form's terms scale with s·b·h and a·s/h.

ACF_SEQ, ACF_BATCH = 512, 2
ACF_PAPER = acf.Layer(arch=acf.Arch.PAPER, hidden=512, heads=8)
ACF_LLAMA = acf.Layer(arch=acf.Arch.LLAMA, hidden=512, heads=8, kv_heads=2, ffn=1792, vocab=1000)


@functools.cache
def _acf_rows(layer: acf.Layer) -> tuple:
    return acf.cost_rows(layer, ACF_SEQ, ACF_BATCH)


@pytest.mark.parametrize("layer", [ACF_PAPER, ACF_LLAMA], ids=["paper", "llama"])
@pytest.mark.parametrize(("t", "sp"), [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_activation_bytes_per_layer_are_the_closed_form_with_its_named_differences(
        layer: acf.Layer, t: int, sp: bool) -> None:
    """Each figure is the closed form with the differences the docs name, to within
    ``acf.slack``: the norms' per-token statistics (at most 8 bytes a token each, about 1/h of a
    layer: the closed form leaves them out) and a byte of rounding a node. Full recompute keeps
    the layer's input: exactly the closed form."""
    rows = _acf_rows(layer)
    for rec in Recompute:
        got = acf.layer_bytes(rows, t, sp, rec)
        assert abs(got - acf.explained(layer, ACF_SEQ, ACF_BATCH, t, sp, rec)) <= acf.slack(ACF_SEQ, ACF_BATCH), rec
    assert acf.layer_bytes(rows, t, sp, Recompute.FULL) == acf.closed_form(
        layer, ACF_SEQ, ACF_BATCH, t, sp, Recompute.FULL)


def test_the_differences_by_design_are_the_documented_numbers() -> None:
    """The differences as numbers, bytes / (s·b·h) at a·s/h = 8, so that the figure and the
    closed form cannot move apart unnoticed (tolerance: the norms' statistics, 16/h)."""
    sbh, tol = ACF_SEQ * ACF_BATCH * 512, 16 / 512

    def per(layer: acf.Layer, t: int, sp: bool, rec: Recompute) -> float:
        return acf.layer_bytes(_acf_rows(layer), t, sp, rec) / sbh

    def paper(t: int, sp: bool, rec: Recompute) -> float:
        return acf.closed_form(ACF_PAPER, ACF_SEQ, ACF_BATCH, t, sp, rec) / sbh

    none, sel = Recompute.NONE, Recompute.SELECTIVE
    # the paper's layer: 34 + 5as/h = 74, its dropout masks a byte an element, as a GPU keeps them
    # (the CPU's noise in bf16, counted before, gave 36 + 6as/h = 84)
    assert (paper(1, False, none), per(ACF_PAPER, 1, False, none)) == (74, pytest.approx(74, abs=tol))
    # T = 4 with SP: 74 / 4 = 18.5, and the norms' gathered outputs 4 (1 − 1/4)
    assert (paper(4, True, none), per(ACF_PAPER, 4, True, none)) == (18.5, pytest.approx(21.5, abs=tol))
    # selective: pipecut recomputes every second layer whole, the paper the attention core
    assert (paper(1, False, sel), per(ACF_PAPER, 1, False, sel)) == (34, pytest.approx((74 + 2) / 2, abs=tol))
    # Llama (flash SDPA, no dropout): norms 16, q k v and output 8, SwiGLU 8·3.5 = 28, the bf16
    # mask SDPA makes of the bool one 2s/h = 2, the fp32 log-sum-exp 4a/h: 54.06 against 74
    assert per(ACF_LLAMA, 1, False, none) == pytest.approx(16 + 8 + 28 + 2 + 4 * 8 / 512, abs=tol)
    assert per(ACF_LLAMA, 4, True, none) == pytest.approx(2 * (6 / 4 + 2) + (8 + 2 + 28 + 4 * 8 / 512) / 4, abs=tol)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_in_flight_microbatches_are_the_closed_forms_first_stage(k: int) -> None:
    """Rank r of 1F1B keeps K − r microbatches (the first stage K: its L/K layers K times, L
    layers' worth); interleaving's first rank V·K + K − 1 stage-microbatches, the closed form's
    1 + (K − 1)/(K·V) times L layers. Where the closed form assumes more microbatches than there
    are: with M < K, 1F1B keeps M; with M = K, interleaving runs all V·K forwards first."""
    one, inter = ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED_1F1B
    assert acf.in_flight(one, k, 4 * k) == tuple(range(k, 0, -1)) and acf.closed_in_flight(k) == k
    assert acf.in_flight(one, k, k // 2)[0] == k // 2
    for v in (2, 4):
        assert acf.in_flight(inter, k, 4 * k, v)[0] == acf.closed_in_flight(k, v) == v * k + k - 1
        assert acf.in_flight(inter, k, k, v)[0] == v * k


def test_the_first_rank_holds_its_layers_in_flight_and_one_rebuilt_layer() -> None:
    """The planner's walk (``evaluate_run``) on rank 0 of the 4-layer Llama: its layers × the
    microbatches in flight, and per microbatch what the embedding side keeps (the rotary tables
    and the tokens: under 1% of the layers here); with full recompute the layers' inputs in
    place of the layers, and one layer rebuilt in backward, which the closed form leaves out."""
    rows = _acf_rows(ACF_LLAMA)
    whole, inputs = (acf.layer_bytes(rows, 1, False, r) for r in (Recompute.NONE, Recompute.FULL))
    for k, v in ((2, 1), (4, 1), (2, 2)):
        kind = ScheduleKind.INTERLEAVED_1F1B if v > 1 else ScheduleKind.ONE_F_ONE_B
        layers = 4 * acf.in_flight(kind, k, 8, v)[0] / (k * v)  # layer-microbatches on rank 0
        extra = acf.first_rank(rows, k, 8, v, Recompute.NONE, ACF_SEQ) - layers * whole
        assert 0 < extra < 0.01 * layers * whole
        assert acf.first_rank(rows, k, 8, v, Recompute.FULL, ACF_SEQ) == pytest.approx(
            layers * inputs + whole + extra, abs=acf.slack(ACF_SEQ, ACF_BATCH))
