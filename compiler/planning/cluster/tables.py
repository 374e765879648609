"""The cost table of a cluster plan: the model's table priced for the cluster's device (and again
at either end of the figures' range), which sizes T of a tensor group the model and a node allow,
and each size's table at one GPU's share, its products priced again at their smaller shapes.

:func:`priced_table` captures and prices (:func:`pipecut.profile.devices.estimate_captured`; the
model may be on meta), keeping the rows and work the per-op model priced, so that
:func:`priced_at` prices them again at another end of the figures without capturing again.

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
from typing import Any

import torch

from pipecut.cluster import Cluster
from pipecut.core.kinds import TensorShard
from pipecut.core.program import Captured, Inputs
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
from pipecut.passes.partition.rebuild import mark_rebuilt
from pipecut.planning.cluster.figures import Figures
from pipecut.profile.devices import Precision, estimate_captured
from pipecut.profile.flops import NodeWork
from pipecut.profile.hardware import HardwareModel
from pipecut.profile.nodes import LossFn

__all__ = ["PricedTable", "priced_at", "priced_table", "sharded_tables", "tensor_parallel_sizes"]


@dataclasses.dataclass(frozen=True)
class PricedTable:
    """A cost table priced for the cluster's device, with the graph it was captured from."""

    captured: Captured
    nodes: tuple[NodeCost, ...]
    counted: tuple[tuple[NodeCost, ...], Any] | None
    """The rows and work the per-op model priced (None: a family priced by the roofline), so the
    table can be priced again at either end of the figures without capturing again."""


@dataclasses.dataclass
class _Recording:
    """A per-op model that keeps the rows and work it prices."""

    model: HardwareModel
    seen: list[tuple[tuple[NodeCost, ...], Any]] = dataclasses.field(default_factory=list)

    def price(self, rows: tuple[NodeCost, ...], work: Any) -> tuple[NodeCost, ...]:
        self.seen.append((rows, work))
        return self.model.price(rows, work)


def priced_table(model: torch.nn.Module, inputs: Inputs, target: Any, figures: Figures, microbatches: int,
                 loss_fn: LossFn | None) -> PricedTable:
    """The cost table of ``model`` at one microbatch of ``inputs``, priced on ``figures``."""
    recording = _Recording(figures.model) if figures.model is not None else None
    captured, rows = estimate_captured(model, inputs, figures.profile, precision=Precision.BF16,
                                       microbatches=microbatches, loss_fn=loss_fn, target=target,
                                       compute_efficiency=figures.efficiency, cost_model=recording)
    c = figures.cluster
    # Weighed against the slowest link a cut may cross (the network between nodes where
    # there are several): where sending costs less, on NVLink, both are a fraction of a ms,
    # while a mask sent between nodes costs 1.5 ms per microbatch at 8k tokens.
    nodes = mark_rebuilt(rows, c.inter if c.nodes > 1 else c.intra)
    return PricedTable(captured=captured, nodes=nodes, counted=recording.seen[0] if recording and recording.seen else None)


def priced_at(table: PricedTable, model: HardwareModel) -> tuple[NodeCost, ...]:
    """``table``'s rows priced again by ``model`` (the device's per-op model at another end of
    the figures' range), with the rows it marked as rebuilt kept."""
    assert table.counted is not None, "a table priced by the roofline has no per-op work to price again"
    rebuilt = {n.name: n.rebuilt for n in table.nodes}
    return tuple(dataclasses.replace(r, rebuilt=rebuilt.get(r.name, r.rebuilt)) for r in model.price(*table.counted))


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
