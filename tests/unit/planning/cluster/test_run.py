"""The training-run model on constructed workloads: links crossed, layouts, memory pieces."""

from __future__ import annotations

import dataclasses

import pytest

from pipecut.cluster import Cluster, Layout, Link
from pipecut.core.kinds import DataParallelKind, Recompute, ScheduleKind
from pipecut.errors import InputError
from pipecut.passes.costs.workload import Workload
from pipecut.planning.cluster.run import (
    RunCandidate,
    RunShape,
    block_of,
    choose_run,
    evaluate_run,
)
from pipecut.planning.cluster.stage import (
    REDUCE_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    exposed_ms,
    ring_ms,
)

NVLINK = Link(name="nvlink", bandwidth_bytes_per_ms=4e8, latency_ms=0.01)
NET = Link(name="net", bandwidth_bytes_per_ms=5e7, latency_ms=0.02)


def cluster(nodes: int, per_node: int, memory: int = 10**12) -> Cluster:
    return Cluster(nodes=nodes, gpus_per_node=per_node, device="X", memory_bytes=memory,
                   peak_flops=1e15, intra=NVLINK, inter=NET)


def chain(units: int, *, params: int = 1000, cut: int = 1000, act: int = 100, ms: float = 1.0) -> Workload:
    """``units`` blocks ``layers.i`` of equal cost; every cut moves ``cut`` bytes each way."""
    return Workload(
        forward_ms=(ms,) * units, backward_ms=(2 * ms,) * units, param_bytes=(params,) * units,
        activation_bytes=(act,) * units, cut_forward_bytes=(0, *([cut] * (units - 1)), 0),
        cut_backward_bytes=(0, *([cut] * (units - 1)), 0), modules=tuple(f"layers.{i}" for i in range(units)),
    )


def shape(**kw) -> RunShape:
    base = dict(batch_size=4, microbatches=1, tokens_per_sample=10, model_flops_per_token=1.0)
    return RunShape(**{**base, **kw})


def run(work: Workload, c: Cluster, d: int, k: int, layout: Layout = Layout.STAGES_INSIDE_NODES,
        **kw) -> RunCandidate:
    out = evaluate_run(work, block_of(work.modules), shape(**kw), c, replicas=d, stages=k, layout=layout)
    assert isinstance(out, RunCandidate), out
    return out


def test_block_of_groups_units_by_their_block_and_puts_the_rest_in_the_root() -> None:
    assert block_of(["emb", "m.layers.0.attn", "m.layers.0.mlp.up", "m.layers.1", "norm"]) == (-1, 0, 0, 1, -1)


def test_a_cut_between_nodes_pays_the_inter_node_link() -> None:
    work = chain(2, cut=10**6)
    inside, across = run(work, cluster(1, 2), 1, 2), run(work, cluster(2, 1), 1, 2)
    assert inside.cut_links == ("nvlink",) and across.cut_links == ("net",)
    extra = 2 * ((NET.latency_ms + 10**6 / NET.bandwidth_bytes_per_ms)
                 - (NVLINK.latency_ms + 10**6 / NVLINK.bandwidth_bytes_per_ms))
    # one microbatch: the activation crosses forward and its gradient backward, once each
    assert across.step_ms - inside.step_ms == pytest.approx(extra)


def test_a_ring_across_nodes_runs_at_the_inter_node_bandwidth() -> None:
    work = Workload(forward_ms=(1.0,), backward_ms=(2.0,), param_bytes=(10**7,), modules=("emb",))
    inside, across = run(work, cluster(1, 2), 2, 1), run(work, cluster(2, 1), 2, 1)
    assert inside.ring_links == ("nvlink",) and across.ring_links == ("net",)
    gather = ring_ms(10**7, 2, NET)
    scatter = ring_ms(10**7 * REDUCE_BYTES_PER_PARAM / 2, 2, NET)
    # one FSDP unit: gathered before forward, gathered again and reduce-scattered in backward
    assert across.exposed_comm_ms == pytest.approx(2 * gather + scatter)
    assert across.step_ms == pytest.approx(1.5 + 2 * gather + scatter)
    assert inside.exposed_comm_ms < across.exposed_comm_ms


def test_collectives_hide_behind_the_previous_units_compute() -> None:
    assert exposed_ms([3.0, 1.0, 5.0], [2.0, 4.0, 9.0]) == 3.0 + 0.0 + 1.0
    assert ring_ms(100, 1, NET) == 0.0


@pytest.mark.parametrize(("params", "cut", "layout"), [
    (10, 10**8, Layout.STAGES_INSIDE_NODES),  # big activations: keep the cuts on NVLink
    (10**8, 10, Layout.REPLICAS_INSIDE_NODES),  # big weights: keep the FSDP rings on NVLink
])
def test_placement_picks_the_faster_layout(params: int, cut: int, layout: Layout) -> None:
    work = chain(4, params=params, cut=cut)
    choice = choose_run(work, block_of(work.modules), shape(microbatches=2), cluster(2, 2), replicas=2)
    assert choice.best is not None and choice.best.placement.layout is layout
    other = [c for c in choice.candidates if c.placement.layout is not layout]
    assert other and other[0].step_ms > choice.best.step_ms


def test_memory_fsdp_shards_state_and_gathers_two_blocks() -> None:
    work = chain(4, params=2000, act=100)
    one = run(work, cluster(1, 2), 2, 1, batch_size=2)
    params = 4 * 2000 / 2
    shard = STATE_BYTES_PER_PARAM * params / 2
    gathered = 2 * 2000 * (1 + REDUCE_BYTES_PER_PARAM / 2)  # two blocks: bf16 weight + fp32 grad
    acts = 4 * 100 / 2
    assert one.peak_memory_bytes == int(shard + gathered + acts)
    ddp = run(work, cluster(1, 2), 2, 1, batch_size=2, sharding=DataParallelKind.DDP)
    assert ddp.peak_memory_bytes == int(STATE_BYTES_PER_PARAM * params + acts)


def test_memory_fsdp_with_stages_keeps_the_stage_unsharded_with_fp32_gradients() -> None:
    # K > 1: the stage is gathered once a step; its gradients accumulate unsharded over the
    # microbatches in the reduce dtype (fp32) until the last backward reduce-scatters them.
    work = chain(4, params=2000, act=100)
    two = run(work, cluster(1, 4), 2, 2, batch_size=2, microbatches=1)
    stage_params = 2 * 2000 / 2  # two units of the stage, bf16 bytes per parameter
    shard = STATE_BYTES_PER_PARAM * stage_params / 2
    unsharded = 2 * 2000 * (1 + REDUCE_BYTES_PER_PARAM / 2)  # bf16 weights + fp32 gradients
    assert dict(two.memory_parts)["state"] == pytest.approx(shard + unsharded)


def test_zero1_as_megatron_s_distributed_optimizer_holds_and_moves_less_than_pipecut_s() -> None:
    """pipecut's ZeRO-1 (torch's ZeroRedundancyOptimizer: 8 + 8/D bytes per parameter, an
    all-reduce then the fp32 weights gathered) against Megatron's distributed optimizer (6 +
    12/D, the fp32 gradients reduce-scattered and the bf16 weights gathered), and either's
    collectives hidden unit by unit where the framework overlaps them."""
    work = chain(4, params=2 * 10**6, act=100, ms=5.0)
    c = cluster(2, 1)  # the two replicas on two nodes: the ring crosses the network
    ours = run(work, c, 2, 1, batch_size=2, sharding=DataParallelKind.ZERO1)
    megatron = run(work, c, 2, 1, batch_size=2, sharding=DataParallelKind.ZERO1, distributed_optimizer=True)
    params = 4 * 2 * 10**6 / 2
    assert dict(ours.memory_parts)["state"] == pytest.approx(params * (8 + 8 / 2))
    assert dict(megatron.memory_parts)["state"] == pytest.approx(params * (6 + 12 / 2))
    bf16, fp32 = ring_ms(2 * 10**6, 2, NET), ring_ms(4 * 10**6, 2, NET)  # one ring pass of one unit's weights
    # not overlapped: one collective of the stage's bytes each (the four units' 8e6 bytes)
    bf16_all, fp32_all = ring_ms(8 * 10**6, 2, NET), ring_ms(16 * 10**6, 2, NET)
    assert ours.exposed_comm_ms == pytest.approx(2 * bf16_all + fp32_all)  # all-reduce, then the fp32 weights gathered
    assert megatron.exposed_comm_ms == pytest.approx(fp32_all + bf16_all)  # fp32 gradients scattered, bf16 weights gathered
    hidden = run(work, c, 2, 1, batch_size=2, sharding=DataParallelKind.ZERO1, distributed_optimizer=True,
                 overlapped_reduction=True)
    # each unit's reduction under the next unit's backward, its gather under the next forward: the first of each shows
    back, fwd = 2 * 5.0, 5.0
    assert hidden.exposed_comm_ms == pytest.approx(fp32 + 3 * max(0.0, fp32 - back) + bf16 + 3 * max(0.0, bf16 - fwd))
    assert hidden.exposed_comm_ms < megatron.exposed_comm_ms and hidden.step_ms < megatron.step_ms


def test_megatron_s_distributed_optimizer_with_bf16_gradients_holds_4_plus_16_over_d() -> None:
    """Megatron's 16-bit-gradient row (4 + 16/D bytes per parameter) and its reduce-scatter at
    half the bytes; refused without the distributed optimizer, which alone is priced that way."""
    work = chain(4, params=2 * 10**6, act=100, ms=5.0)
    c = cluster(2, 1)
    fp32 = run(work, c, 2, 1, batch_size=2, sharding=DataParallelKind.ZERO1, distributed_optimizer=True)
    bf16 = run(work, c, 2, 1, batch_size=2, sharding=DataParallelKind.ZERO1, distributed_optimizer=True,
               bf16_gradients=True)
    params = 4 * 2 * 10**6 / 2
    assert dict(bf16.memory_parts)["state"] == pytest.approx(params * (4 + 16 / 2))
    assert dict(fp32.memory_parts)["state"] == pytest.approx(params * (6 + 12 / 2))
    whole = ring_ms(8 * 10**6, 2, NET)  # the stage's bf16 bytes, one ring pass
    assert bf16.exposed_comm_ms == pytest.approx(whole + whole)  # bf16 gradients scattered, bf16 weights gathered
    with pytest.raises(InputError, match="distributed_optimizer=True"):
        run(work, c, 2, 1, batch_size=2, sharding=DataParallelKind.ZERO1, bf16_gradients=True)


def test_memory_checkpointing_keeps_block_inputs() -> None:
    work = dataclasses.replace(chain(4, act=1000, cut=10), cut_forward_bytes=(10,) * 5)
    full = run(work, cluster(1, 1), 1, 1, batch_size=1, recompute=Recompute.FULL)
    none = run(work, cluster(1, 1), 1, 1, batch_size=1, recompute=Recompute.NONE)
    selective = run(work, cluster(1, 1), 1, 1, batch_size=1, recompute=Recompute.SELECTIVE)
    state = none.peak_memory_bytes - 4 * 1000
    assert full.peak_memory_bytes == state + 4 * 10 + 1000  # inputs kept, one block recomputed
    assert selective.peak_memory_bytes == state + 2 * 1000 + 2 * 10 + 1000
    assert full.compute_ms == none.compute_ms + 4.0  # each block's forward again
    assert selective.compute_ms == none.compute_ms + 2.0


def test_pipeline_bubble_and_tokens() -> None:
    work = chain(4)
    c = run(work, cluster(1, 2), 1, 2, microbatches=4, schedule=ScheduleKind.GPIPE, batch_size=4)
    assert c.bubble_fraction == pytest.approx(1 / 5, abs=0.05)  # (K − 1) / (M + K − 1)
    assert c.tokens_per_s_per_gpu == pytest.approx(4 * 10 / (c.step_ms / 1e3) / 2)


def test_shapes_that_do_not_split_the_batch_are_skipped_with_the_reason() -> None:
    work = chain(4)
    out = evaluate_run(work, block_of(work.modules), shape(batch_size=3), cluster(1, 2),
                       replicas=2, stages=1, layout=Layout.STAGES_INSIDE_NODES)
    assert not isinstance(out, RunCandidate) and "does not split over 2 replicas" in out.reason
