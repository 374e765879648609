"""pipecut.planning.cluster.choose: the fastest D × T × K that fits, under each engine; the
refusal with the memory needed and the smallest cluster that fits."""

from __future__ import annotations

import dataclasses

import pytest

from pipecut.cluster import Cluster, Layout
from pipecut.core.kinds import DataParallelKind, NodeOp
from pipecut.errors import PartitionError
from pipecut.ir import NodeCost
from pipecut.planning.cluster.choose import TableSplits, predict_run
from pipecut.planning.cluster.figures import parse_cluster
from pipecut.planning.cluster.run import RunShape


def _heavy_rows(blocks: int, param_bytes: int) -> tuple[NodeCost, ...]:
    rows = [NodeCost(name="x", op=NodeOp.PLACEHOLDER, target="x")]
    prev = "x"
    for i in range(blocks):
        rows.append(NodeCost(name=f"b{i}", op=NodeOp.CALL_MODULE, target="blk", module=f"layers.{i}",
                             inputs=(prev,), forward_ms=1.0, backward_ms=2.0, param_bytes=param_bytes,
                             parameters=(f"layers.{i}.w",)))
        prev = f"b{i}"
    rows.append(NodeCost(name="output", op=NodeOp.OUTPUT, target="output", inputs=(prev,)))
    return tuple(rows)


def test_a_model_that_does_not_fit_is_refused_with_its_need_and_the_smallest_cluster() -> None:
    # 6e9 parameters: 96 GB of state on one GPU; FSDP over 2 halves it (plus two gathered blocks)
    rows = _heavy_rows(4, 3 * 10**9)
    shape = RunShape(batch_size=2, microbatches=1, tokens_per_sample=1, model_flops_per_token=1.0)
    with pytest.raises(PartitionError, match=r"needs at least \d+\.\d GiB per GPU.*smallest H100-SXM "
                                             r"cluster that fits is 2x1xH100-SXM"):
        predict_run(rows, parse_cluster("1x1xH100-SXM"), shape)
    best, _, _ = predict_run(rows, parse_cluster("2x1xH100-SXM"), shape)
    assert best.placement.replicas == 2 and isinstance(parse_cluster("2x1xH100-SXM"), Cluster)
    assert best.placement.layout is Layout.STAGES_INSIDE_NODES


def test_zero1_is_priced_between_ddp_and_fsdp_and_weighed_by_default() -> None:
    """4 blocks of 1.5e9 bf16 parameters on 2 H100 at one replica each (D = 2, K = 1): DDP's 16
    bytes per parameter (96 GB) do not fit in 80 GB; ZeRO-1's 8 + 8 / 2 (72 GB) do, FSDP2's
    16 / 2 plus two gathered blocks too. Each engine's state term is the one documented, and its
    traffic: ZeRO-1 adds the broadcast of the fp32 weights to DDP's all-reduce."""
    from pipecut.planning.cluster.choose import fastest_engine

    rows = _heavy_rows(4, 3 * 10**9)
    cluster = parse_cluster("1x2xH100-SXM")
    shape = RunShape(batch_size=2, microbatches=1, tokens_per_sample=1, model_flops_per_token=1.0)
    runs = {}
    for kind in (DataParallelKind.ZERO1, DataParallelKind.FSDP):
        best, _, _ = predict_run(rows, cluster, dataclasses.replace(shape, sharding=kind), replicas=2)
        runs[kind] = best
    state = {k: dict(b.memory_parts)["state"] for k, b in runs.items()}
    params = 4 * 1.5e9
    assert state[DataParallelKind.ZERO1] == pytest.approx(params * (8 + 8 / 2), rel=1e-6)
    with pytest.raises(PartitionError, match="pipeline × ddp"):
        predict_run(rows, cluster, dataclasses.replace(shape, sharding=DataParallelKind.DDP), replicas=2)
    best, _, kind = fastest_engine(rows, cluster, shape, (DataParallelKind.DDP, DataParallelKind.ZERO1,
                                                           DataParallelKind.FSDP), replicas=2)
    assert kind in (DataParallelKind.ZERO1, DataParallelKind.FSDP)
    assert best.step_ms == min(r.step_ms for r in runs.values())
    with pytest.raises(PartitionError, match=r"under no engine of the replicas: sharding=.ddp.: .*sharding=.zero1."):
        fastest_engine(rows, parse_cluster("1x1xH100-SXM"), shape, (DataParallelKind.DDP, DataParallelKind.ZERO1))


def test_step_at_prices_the_chosen_run_again_on_another_table_and_links() -> None:
    """The chosen run's split, layout and schedule kept: on its own table and links the step is
    the run's; on a table twice as slow it grows; a run that does not
    run there (the split no longer one of that table's) keeps the run's step."""
    from pipecut.planning.cluster.choose import step_at

    rows = _heavy_rows(8, 10**6)
    cluster = parse_cluster("1x2xH100-SXM")
    shape = RunShape(batch_size=8, microbatches=1, tokens_per_sample=1, model_flops_per_token=1.0)
    best, _, _ = predict_run(rows, cluster, shape)
    assert best.placement.replicas == 2
    assert step_at(best, shape, rows, {}, cluster) == pytest.approx(best.step_ms)
    slow = tuple(dataclasses.replace(r, forward_ms=2 * r.forward_ms, backward_ms=2 * r.backward_ms) for r in rows)
    assert step_at(best, shape, slow, {}, cluster) > 1.5 * best.step_ms
    wide = dataclasses.replace(cluster, nodes=2)  # 4 GPUs: not the run's 2
    assert step_at(best, shape, rows, {}, wide) == best.step_ms


def test_engines_share_their_splits_and_the_wider_search_stops_at_the_first_fit() -> None:
    """A split's time does not depend on the replicas' engine: planned under DDP, FSDP finds every
    split it needs in the shared cache (the cache does not grow) and chooses as it does alone. The
    refusal's wider search asks only whether a run fits: ``first_fit`` returns the first fitting
    run of the full choice, and the refusal names the same smallest cluster."""
    from pipecut.passes.costs.workload import workload
    from pipecut.planning.cluster.run import block_of, choose_run

    rows = _heavy_rows(8, 10**6)
    cluster = parse_cluster("1x4xH100-SXM")
    shape = RunShape(batch_size=8, microbatches=2, tokens_per_sample=1, model_flops_per_token=1.0)
    splits: TableSplits = {}
    predict_run(rows, cluster, dataclasses.replace(shape, sharding=DataParallelKind.DDP), splits=splits)
    kept = {key: dict(found) for key, found in splits.items()}
    assert kept and all(kept.values())
    fsdp = dataclasses.replace(shape, sharding=DataParallelKind.FSDP)
    shared, _, _ = predict_run(rows, cluster, fsdp, splits=splits)
    alone, _, _ = predict_run(rows, cluster, fsdp)
    assert {key: dict(found) for key, found in splits.items()} == kept
    assert (shared.bounds, shared.placement, shared.step_ms) == (alone.bounds, alone.placement, alone.step_ms)

    work = workload(rows)
    full = choose_run(work, block_of(work.modules), shape, cluster)
    first = choose_run(work, block_of(work.modules), shape, cluster, first_fit=True)
    assert len(first.candidates) == 1 and first.candidates[0] in full.candidates
    assert first.candidates[0].peak_memory_bytes <= cluster.memory_bytes
    heavy = _heavy_rows(4, 3 * 10**9)
    one = RunShape(batch_size=2, microbatches=1, tokens_per_sample=1, model_flops_per_token=1.0)
    with pytest.raises(PartitionError, match="smallest H100-SXM cluster that fits is 2x1xH100-SXM"):
        predict_run(heavy, parse_cluster("1x1xH100-SXM"), one, splits={})
