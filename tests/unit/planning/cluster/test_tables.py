"""D × T × K on a cluster: the sizes a model allows, products priced at their share, memory
divided by T, the 70B run that did not fit without tensor parallelism, a plan's JSON with T,
and compile's refusal to run one."""

from __future__ import annotations

import dataclasses

import pytest

import pipecut
from benchmarks import validation
from pipecut import Plan, summary
from pipecut.assemble.choice import check_tensor_group
from pipecut.cluster import ClusterPlacement, Layout
from pipecut.core.kinds import Recompute, TensorShard
from pipecut.errors import InputError, PartitionError, PlanError
from pipecut.passes.parallel.tensor import rank_share
from pipecut.planning.cluster.choose import predict_run
from pipecut.planning.cluster.figures import family_model, parse_cluster
from pipecut.planning.cluster.plan import model_flops_per_token, plan_cluster
from pipecut.planning.cluster.run import RunShape
from pipecut.planning.cluster.tables import sharded_tables, tensor_parallel_sizes
from pipecut.profile.devices import device_profile
from pipecut.report.render import render_html
from tests.unit.tiny import tiny_llama


def _llama(name: str, *, samples: int = 1, seq: int = 8192, cluster: str = "8x8xH100-SXM") -> tuple:
    """The cost table of a published Llama's shapes (benchmarks/validation.py), priced for ``cluster``."""
    c = parse_cluster(cluster)
    m = validation.load()["models"][name]
    rows, work = validation.transformer_rows(m, samples=samples, seq=seq, attention="flash", dropout=False,
                                             loss_fp32=True, head_params=True)
    hw = family_model(device_profile(c.device))
    assert hw is not None
    shape = RunShape(batch_size=64 * samples, microbatches=64, tokens_per_sample=seq, sequence_parallel=True,
                     model_flops_per_token=model_flops_per_token(hw.price(rows, work), layers=m["layers"],
                                                                 hidden=m["hidden"], seq=seq),
                     recompute=Recompute.SELECTIVE)
    return c, hw, rows, work, hw.price(rows, work), shape


def test_sizes_divide_a_node_the_heads_and_the_split_widths() -> None:
    c, _, _, _, nodes, _ = _llama("llama3-70b", seq=128)
    heads = {"attention heads": 64, "KV heads": 8}
    assert tensor_parallel_sizes("auto", nodes, c, heads) == (1, 2, 4, 8)
    assert tensor_parallel_sizes(4, nodes, c, heads) == (4,) and tensor_parallel_sizes(1, nodes, c, {}) == (1,)
    assert tensor_parallel_sizes("auto", nodes, parse_cluster("1x6xH100-SXM"), heads) == (1, 2)
    with pytest.raises(InputError, match=r"tensor_parallel=16 must divide the GPUs per node \(8\) and the "
                                         r"attention heads \(12\).*sizes that run: 1, 2, 4 \(or 'auto'\)"):
        tensor_parallel_sizes(16, nodes, c, {"attention heads": 12})
    with pytest.raises(InputError, match="give 'auto' or a size"):
        tensor_parallel_sizes("eight", nodes, c, heads)


def test_a_split_product_is_priced_at_its_share_of_the_shape() -> None:
    c, hw, rows, work, nodes, _ = _llama("llama3-70b", seq=1024)
    tables = sharded_tables(nodes, (1, 8), c, sequence_parallel=True, model=hw, counted=(rows, work))
    assert set(tables) == {8}
    full = {n.name: n for n in nodes}
    eighth = {n.name: n for n in tables[8].nodes}
    qkv = "l0_qkv"
    comm = tables[8].collectives[qkv]
    alone = eighth[qkv].forward_ms - comm[0]
    # at 1/8 of the output features a product is no more efficient, and here a little less
    assert full[qkv].forward_ms / 8 <= alone < full[qkv].forward_ms
    assert comm[0] > 0 and comm[1] > 0  # all-gather forward, reduce-scatter backward


def test_memory_per_gpu_is_divided_by_t() -> None:
    c, hw, rows, work, nodes, shape = _llama("llama3-8b", seq=1024, cluster="1x8xH100-SXM")
    tables = sharded_tables(nodes, (2,), c, sequence_parallel=True, model=hw, counted=(rows, work))
    plain, _, _ = predict_run(nodes, parse_cluster("1x4xH100-SXM"), shape, replicas=1)
    split, _, _ = predict_run(nodes, c, shape, replicas=1, tensor_parallel=(2,), sharded=tables)
    assert (plain.placement.stages, split.placement.stages, split.placement.tensor_parallel) == (4, 4, 2)
    state = {name: b for name, b in plain.memory_parts}, {name: b for name, b in split.memory_parts}
    # the norms stay whole, and the two splits differ a little
    assert state[1]["state"] / state[0]["state"] == pytest.approx(0.5, abs=0.05)
    assert state[1]["activations"] / state[0]["activations"] == pytest.approx(0.5, abs=0.05)
    assert any(name.endswith("(tensor parallel)") for name, _ in split.parts)


def test_the_70b_run_that_needed_128_nodes_plans_on_64_gpus_with_tp() -> None:
    """``pipecut plan examples.llama_meta:build_70b --batch-size 64 --microbatches 64 --cluster
    8x8xH100-SXM``: one sample a microbatch allows no data parallelism, and 1 × 64 stages keeps
    64 microbatches of activations on the first GPU."""
    c, hw, rows, work, nodes, shape = _llama("llama3-70b")
    tables = sharded_tables(nodes, (2, 4, 8), c, sequence_parallel=True, model=hw, counted=(rows, work))
    best, choice, _ = predict_run(nodes, c, shape, tensor_parallel=(1, 2, 4, 8), sharded=tables)
    assert best.placement.tensor_parallel == 8 and best.placement.replicas * best.placement.stages == 8
    assert best.peak_memory_bytes <= c.memory_bytes and best.tokens_per_s_per_gpu > 0
    assert {s.tensor_parallel for s in choice.skipped} == {1, 2, 4, 8}
    assert all(r.placement.tensor_parallel > 1 for r in choice.candidates)  # without TP nothing fits


def test_the_refusal_names_tensor_parallelism_as_a_fix() -> None:
    c, _, _, _, nodes, shape = _llama("llama3-8b", seq=8192, cluster="1x2xH100-SXM")
    shape = dataclasses.replace(shape, batch_size=8, microbatches=8, recompute=Recompute.NONE)
    with pytest.raises(PartitionError, match=r"needs at least .* GiB per GPU.*or tensor_parallel='auto'"):
        predict_run(nodes, c, shape)


def test_a_tp_plan_records_t_and_its_groups_and_round_trips() -> None:
    model, batch = tiny_llama(heads=4, kv_heads=2, batch=4, seq=32, vocab=128)
    plan = plan_cluster(model, batch, "1x4xH100-SXM", microbatches=2, tensor_parallel=2,
                        data_parallel=pipecut.DataParallelOptions(replicas=1))
    place = plan.placement
    assert place is not None and plan.run is not None
    assert (place.replicas, place.stages, place.tensor_parallel) == (1, 2, 2)
    assert place.tensor_groups() == ((0, 1), (2, 3)) and place.grid() == ((0, 0), (0, 0), (0, 1), (0, 1))
    assert plan.run.sequence_parallel and any("pipecut.compile runs this plan over a DeviceMesh with dimensions "
                                              "('dp', 'pp', 'tp') and tp=2" in n for n in plan.run.notes)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.placement == place
    text = summary(plan)
    assert "1 replicas x 2 stages x tensor parallel 2" in text and "GPUs 0-1 (r0 s0), 2-3 (r0 s1)" in text
    page = render_html(plan)
    assert 'id="tensor-groups"' in page and "GPUs 0–1; GPUs 2–3" in page and "tensor rank 1 of 2" in page
    with pytest.raises(PlanError, match=r"groups of 2 GPUs \(placement.tensor_parallel=2\), but the devices have no "
                                        r"'tp' dimension; compile it over init_device_mesh\(..., \(1, 2, 2\)"):
        check_tensor_group(plan, 4)
    check_tensor_group(dataclasses.replace(plan, placement=dataclasses.replace(place, tensor_parallel=1)), 2)
    # the plan's rows keep the captured shapes, which compile's wiring reads; the times are one GPU's
    whole = pipecut.plan(model, batch, 2, microbatches=2, schedule="1f1b", measure=pipecut.MeasureOptions(estimate="H100-SXM"))
    shapes = {n.name: (n.shape, n.leaves) for n in whole.nodes}
    common = [n for n in plan.nodes if n.name in shapes]
    assert len(common) > len(plan.nodes) // 2
    assert all(shapes[n.name] == (n.shape, n.leaves) for n in common), [n.name for n in common if shapes[n.name] != (n.shape, n.leaves)][:5]
    with pytest.raises(InputError, match="tensor_parallel=3 must divide"):
        plan_cluster(model, batch, "1x4xH100-SXM", microbatches=2, tensor_parallel=3)


def test_placement_lays_tensor_groups_inside_nodes() -> None:
    place = ClusterPlacement(layout=Layout.REPLICAS_INSIDE_NODES, replicas=2, stages=2, tensor_parallel=4)
    assert place.gpus == 16 and place.gpu(1, 0) == 4 and place.tensor_group(0, 1) == (8, 9, 10, 11)
    assert place.replica_group(1) == (8, 12)
    with pytest.raises(InputError, match="tensor parallelism ≥ 1"):
        ClusterPlacement(layout=Layout.STAGES_INSIDE_NODES, replicas=1, stages=1, tensor_parallel=0)


def test_compile_plans_one_ranks_share_and_prices_what_crosses_a_cut_as_it_travels() -> None:
    """compile over a "tp" dimension partitions the measured table at one rank's share: times
    and weights divided where the graph splits, collectives added, shapes whole (the wiring
    reads them), sent bytes as they travel (whole; token shards with sequence parallelism)."""
    _, _, _, _, nodes, _ = _llama("llama3-70b", seq=1024)
    link = parse_cluster("8x8xH100-SXM").intra
    share = {n.name: n for n in rank_share(nodes, 8, link)}
    table = sharded_tables(nodes, (8,), parse_cluster("8x8xH100-SXM"), sequence_parallel=False)[8]
    assert rank_share(nodes, 1, link) == tuple(nodes)
    for n in nodes:
        s = share[n.name]
        assert (s.shape, s.output_bytes, s.leaves) == (n.shape, n.output_bytes, n.leaves), n.name
    split = [n for n in nodes if table.kinds.get(n.name) is TensorShard.COLUMN]
    assert split and all(share[n.name].forward_ms < n.forward_ms for n in split)
    assert sum(s.param_bytes for s in share.values()) < sum(n.param_bytes for n in nodes) / 4
    assert any(share[name].forward_ms > 0 for name in table.collectives)
    # with sequence parallelism the residual stream crosses cuts as token shards: a T-th of its
    # bytes (shapes whole: the wiring divides them); a split region's values still go whole
    tokens = {n.name: n for n in rank_share(nodes, 8, link, sequence_parallel=True)}
    stream = [n for n in nodes if table.kinds.get(n.name) is TensorShard.ROW]
    assert stream and all(tokens[n.name].output_bytes == -(-n.output_bytes // 8) for n in stream)
    assert all(tokens[n.name].output_bytes == n.output_bytes for n in split)
    assert all((tokens[n.name].shape, tokens[n.name].leaves) == (n.shape, n.leaves) for n in nodes)


def test_plan_with_a_cluster_takes_sequence_parallel_from_the_options() -> None:
    """``plan(cluster=...)`` read only the size of ``TensorParallelOptions`` and priced sequence
    parallelism whatever was asked; not given (None) it is on, as in ``plan_cluster``."""
    import pipecut

    model, batch = tiny_llama(heads=4, kv_heads=2, batch=4, seq=32, vocab=128)
    runs = {}
    for asked in (None, False, True):
        options = pipecut.TensorParallelOptions(size=2, sequence_parallel=asked)
        plan = pipecut.plan(model, batch, cluster="1x4xH100-SXM", microbatches=2, tensor_parallel=options,
                            data_parallel=pipecut.DataParallelOptions(kind="fsdp", replicas=1))
        assert plan.run is not None and plan.placement is not None and plan.placement.tensor_parallel == 2
        assert plan.options is not None and plan.options.tensor_parallel.sequence_parallel is asked
        runs[asked] = plan.run
    assert runs[None].sequence_parallel and runs[True].sequence_parallel and not runs[False].sequence_parallel
    assert runs[None].step_ms == runs[True].step_ms != runs[False].step_ms
    # the same plan through plan_cluster, from the same option objects
    direct = plan_cluster(model, batch, "1x4xH100-SXM", microbatches=2,
                          tensor_parallel=pipecut.TensorParallelOptions(size=2),
                          data_parallel=pipecut.DataParallelOptions(kind="fsdp", replicas=1))
    assert direct.run == runs[None]
    with pytest.raises(InputError, match="sequence_parallel='yes'"):
        pipecut.TensorParallelOptions(sequence_parallel="yes")  # type: ignore[arg-type]


def test_a_priced_table_prices_again_at_either_end_without_capturing() -> None:
    """The rows the per-op model priced are kept: priced again by the same model they come back
    as the table's, with its rebuilt marks; by the fast end's model no row is slower."""
    from pipecut.planning.cluster.figures import figures_of
    from pipecut.planning.cluster.tables import priced_at, priced_table
    from pipecut.profile.hardware import FigureEnd
    from tests.unit.tiny import tiny_llama

    model, batch = tiny_llama()
    figures = figures_of("1x8xH100-SXM")
    table = priced_table(model, batch, None, figures, 2, None)
    assert table.counted is not None and figures.model is not None
    assert priced_at(table, figures.model) == table.nodes
    fast = figures.at(FigureEnd.FAST).model
    assert fast is not None
    again = priced_at(table, fast)
    assert [r.name for r in again] == [r.name for r in table.nodes]
    assert all(a.forward_ms <= r.forward_ms + 1e-12 for a, r in zip(again, table.nodes))
    assert sum(a.forward_ms for a in again) < sum(r.forward_ms for r in table.nodes)
