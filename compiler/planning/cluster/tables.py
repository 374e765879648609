"""The cost table at one GPU's share of a T-way tensor group, for a cluster plan: which sizes T a
model and a node allow, and each size's table, its products priced again at their smaller shapes.

The regions, collectives and divided bytes are the pass's (:mod:`pipecut.passes.parallel.tensor`);
this module adds what needs the front end: the model's attention heads (a group splits whole
heads, and whole KV heads: :mod:`pipecut.planning.tensor_parallel`), and the per-op hardware
model (:mod:`pipecut.profile.hardware`), which prices a product by its shape, so a column product
of ``n / T`` output features on a GPU is priced at that width (its tile and wave quantization),
not as the full product divided by T.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from pipecut.cluster import Cluster
from pipecut.core.kinds import TensorShard
from pipecut.errors import InputError
from pipecut.ir import NodeCost
from pipecut.passes.parallel.tensor import (
    ShardedTable,
    check_tensor_parallel,
    shard_kinds,
    shard_table,
    sharded_widths,
    split_work,
    tensor_sizes,
)
from pipecut.profile.flops import NodeWork
from pipecut.profile.hardware import HardwareModel

__all__ = ["sharded_tables", "tensor_parallel_sizes"]


def tensor_parallel_sizes(asked: str | int, nodes: Sequence[NodeCost], cluster: Cluster,
                          heads: Mapping[str, int]) -> tuple[int, ...]:
    """The T to weigh: with "auto" every size that divides a node's GPUs and the heads (1
    first); a number is checked and weighed alone. Where the model names no heads (no Hugging
    Face config), the widths the group splits stand in for them (``sharded_widths``); where it
    does, an odd vocabulary is not a bar (Megatron pads it, DTensor shards it unevenly).

    Raises:
        InputError: ``asked`` is neither "auto" nor a size that divides them (the sizes that
            would run are named).
    """
    if isinstance(asked, bool) or not (asked == "auto" or isinstance(asked, int)):
        raise InputError(f"tensor_parallel={asked!r}: give 'auto' or a size (1 plans without it)")
    if asked == 1:
        return (1,)
    counts = dict(heads) or {f"split width {w}": w for w in sharded_widths(nodes, shard_kinds(nodes))}
    if asked == "auto":
        return tensor_sizes(cluster.gpus_per_node, tuple(counts.values()))
    assert isinstance(asked, int)
    check_tensor_parallel(asked, cluster.gpus_per_node, counts)
    return (asked,)


def sharded_tables(
    nodes: Sequence[NodeCost], sizes: Sequence[int], cluster: Cluster, *, sequence_parallel: bool,
    model: HardwareModel | None = None, counted: tuple[Sequence[NodeCost], Mapping[str, NodeWork]] | None = None,
    overlapped: bool = False, regather: bool = False,
) -> dict[int, ShardedTable]:
    """Per size T > 1 of ``sizes``: ``nodes`` as one GPU of a T-way group on the cluster's
    NVLink runs them. With the per-op ``model`` and the rows and work it priced ``nodes`` from
    (``counted``), every divided node is priced again at 1/T of its FLOPs and bytes, a column
    product at 1/T of its output features; without, its times are divided by T. ``overlapped``:
    the collectives as async tensor parallelism hides them; ``regather``: sequence parallelism's
    gathered inputs kept as their shards and gathered again in the backward, as Megatron runs it
    (both :func:`shard_table`)."""
    kinds = shard_kinds(nodes)
    out = {}
    for t in sizes:
        if t <= 1:
            continue
        times = None
        if model is not None and counted is not None:
            divided = split_work(kinds, nodes, sequence_parallel=sequence_parallel)
            times = _priced_share(model, counted, divided, kinds, t)
        out[t] = shard_table(nodes, t, cluster.intra, sequence_parallel=sequence_parallel, times=times,
                             overlapped=overlapped, regather=regather)
    return out


def _priced_share(model: HardwareModel, counted: tuple[Sequence[NodeCost], Mapping[str, NodeWork]],
                  divided: frozenset[str], kinds: Mapping[str, TensorShard], t: int) -> dict[str, tuple[float, float]]:
    """(forward, backward) ms of each divided node at its 1/T share, by the per-op model."""
    rows, work = counted
    mine = tuple(_share_shape(r, kinds.get(r.name), t) for r in rows if r.name in divided)
    shares = {r.name: _share_work(work.get(r.name, NodeWork()), t) for r in mine}
    return {r.name: (r.forward_ms, r.backward_ms) for r in model.price(mine, shares)}


def _share_work(w: NodeWork, t: int) -> NodeWork:
    return NodeWork(forward_flops=math.ceil(w.forward_flops / t), backward_flops=math.ceil(w.backward_flops / t),
                    forward_bytes=math.ceil(w.forward_bytes / t), backward_bytes=math.ceil(w.backward_bytes / t))


def _share_shape(row: NodeCost, kind: TensorShard | None, t: int) -> NodeCost:
    """A row's output shape on one GPU, as far as a product's efficiency reads it: a column
    product's output features / T; a split batched product's first head-like dimension / T."""
    shape = tuple(row.shape or ())
    if not shape:
        return row
    if kind is TensorShard.COLUMN and shape[-1] % t == 0:
        return dataclasses.replace(row, shape=(*shape[:-1], shape[-1] // t))
    if kind is TensorShard.SPLIT and len(shape) > 2:
        for i, s in enumerate(shape[:-2]):
            if s % t == 0 and s >= t:
                return dataclasses.replace(row, shape=(*shape[:i], s // t, *shape[i + 1:]))
    return row
