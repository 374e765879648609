"""Tensor parallelism inside a stage: which nodes a group of T GPUs splits, and its collectives.

Pure numbers over the cost table, no torch. Megatron's pairing (Shoeybi et al. 2019, §3): a
product whose weight is split by output features (*column*: q/k/v, gate/up, the LM head) opens
a sharded region; the work on its output (attention heads, the MLP's hidden features, a
vocabulary-parallel loss) is split; a product whose weight is split by input features (*row*: o,
down) closes it with partial sums reduced across the group. :func:`shard_kinds` finds the
regions from the graph alone, so any decoder whose blocks pair their products this way is
covered, whatever its module names::

    replicated value ─f─▶ column ─▶ split … split ─▶ row ─g─▶ replicated value

``g`` reduces (all-reduce forward, nothing backward); ``f`` is its mirror (nothing forward,
all-reduce of the input gradient backward): two all-reduces forward and two backward per
transformer block. With **sequence parallelism** (Korthikanti et al. 2022) the replicated values
are split along the sequence instead: ``g`` becomes a reduce-scatter forward (all-gather
backward) and ``f`` an all-gather forward (reduce-scatter backward), the same bytes on the wire,
and the norms, residual adds and their activations are divided by T too, except what a column
product reads: it is all-gathered, and autograd keeps the gathered copy whole (as DTensor runs
it; Megatron-LM keeps the shard and gathers again in backward). An embedding lookup on
a vocabulary shard is reduced like ``g``. All of them run on the tensor group's link (NVLink:
the group stays inside a node) and are exposed: the next kernel needs their result. *Async*
tensor parallelism (torch's micro-pipelined TP, as torchtitan runs it) splits each collective
into chunks that run under the product that reads or writes its buffer: priced
(``shard_table(..., overlapped=True)``) as exposed only where the collective takes longer than
that product, an optimistic bound (the first or last chunk cannot hide).

:func:`shard_table` turns a full cost table into one GPU's share: parameters of the split
products divided by T (and so the state FSDP shards and the gradients it reduces), activations
of the split values divided by T, times of the split work given (priced again by the caller at
the smaller shapes) or divided by T, and every collective added to the node it follows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pipecut.cluster import Link
from pipecut.core.kinds import LeafKind, NodeOp, TensorShard
from pipecut.core.shapes import token_dim
from pipecut.errors import InputError
from pipecut.ir import NodeCost
from pipecut.passes.costs.stages import ring_ms

__all__ = [
    "ParameterShard",
    "ShardedTable",
    "check_tensor_parallel",
    "collectives",
    "gathered_inputs",
    "parameter_shards",
    "rank_share",
    "residual_stream",
    "shard_kinds",
    "shard_table",
    "sharded_widths",
    "split_outputs",
    "split_work",
    "tensor_sizes",
]

_PRODUCTS = ("linear", "mm", "matmul")
_NOT_PRODUCTS = ("embedding", "norm")


def _weights(node: NodeCost, by_name: Mapping[str, NodeCost]) -> tuple[str, ...]:
    """The names of the weight matrices ``node`` reads: ``get_attr`` parameters that are not
    vectors (of two or more dimensions, or of no recorded shape), or the node itself for a
    module call that holds its own parameters."""
    own = (node.name,) if node.op is NodeOp.CALL_MODULE and node.param_bytes > 0 else ()
    return own + tuple(i for i in node.inputs if by_name[i].op is NodeOp.GET_ATTR and by_name[i].param_bytes > 0
                       and len(by_name[i].shape or (0, 0)) >= 2)


def _what(node: NodeCost, classes: Mapping[str, str]) -> str:
    """What a node calls, lower case: its target, or for a module call its class where known."""
    if node.op is NodeOp.CALL_MODULE and node.target in classes:
        return classes[node.target].lower()
    return node.target.lower()


def _is_product(node: NodeCost, classes: Mapping[str, str]) -> bool:
    t = _what(node, classes)
    if node.op is NodeOp.CALL_MODULE:
        return not any(x in t or x in node.module.lower() for x in _NOT_PRODUCTS) and not _holds_vectors(node)
    return any(p in t for p in _PRODUCTS)


def _is_lookup(node: NodeCost, classes: Mapping[str, str], by_name: Mapping[str, NodeCost]) -> bool:
    """An embedding lookup: by its target or class, or a module call whose inputs (its own
    parameters aside) are all integers (token ids), whatever the module's name (``tok_emb``)."""
    if "embedding" in _what(node, classes):
        return True
    if node.op is not NodeOp.CALL_MODULE:
        return False
    read = [by_name[i] for i in node.inputs if by_name[i].op is not NodeOp.GET_ATTR]
    return bool(read) and all((r.dtype or "").startswith(("int", "uint")) for r in read)


def _holds_vectors(node: NodeCost) -> bool:
    """A module call whose parameters are at most two vectors as wide as its output: a norm's
    weight and bias, whatever the module's name (``ln1``, ``ln_f``; the table names a module
    call by its path, and its class is known only where ``classes`` is given). A product's
    weight is a matrix: ``nn.Linear(i, o)`` holds ``(i + 1)·o`` elements, more than two
    vectors of ``o`` at up to four bytes an element for any ``i > 3`` (eight for float64)."""
    width = node.shape[-1] if node.shape else 0
    element = 8 if node.dtype and "64" in node.dtype else 4  # the widest a parameter may be beside its output
    return 0 < node.param_bytes <= 2 * width * element


def shard_kinds(nodes: Sequence[NodeCost], classes: Mapping[str, str] | None = None) -> dict[str, TensorShard]:
    """Every node's :class:`~pipecut.core.kinds.TensorShard`, walking the table in topological
    order: a product reading a weight is COLUMN on a replicated input and ROW on a sharded one;
    an embedding lookup with a weight is VOCAB; anything else is SPLIT when it reads a sharded
    value, else REPLICATED. ``classes``: the class name of each called module, by its path
    (the table names a module call by its path only: ``embed``, ``norm``).

    >>> from pipecut.ir import NodeCost
    >>> from pipecut.core.kinds import NodeOp
    >>> w = lambda n: NodeCost(name=n, op=NodeOp.GET_ATTR, target=n, param_bytes=8, shape=(2, 2))
    >>> f = lambda n, t, *i: NodeCost(name=n, op=NodeOp.CALL_FUNCTION, target=t, inputs=i)
    >>> t = [NodeCost(name="x", op=NodeOp.PLACEHOLDER, target="x"), w("w1"), w("w2"),
    ...      f("up", "linear", "x", "w1"), f("act", "gelu", "up"), f("down", "linear", "act", "w2"),
    ...      f("add", "add", "x", "down")]
    >>> [k.value for k in shard_kinds(t).values()][3:]
    ['column', 'split', 'row', 'replicated']
    """
    by_name = {n.name: n for n in nodes}
    classes = classes or {}
    kinds: dict[str, TensorShard] = {}
    sharded: set[str] = set()
    for n in nodes:
        if n.op in (NodeOp.PLACEHOLDER, NodeOp.GET_ATTR):
            kinds[n.name] = TensorShard.REPLICATED
            continue
        weights = _weights(n, by_name)
        reads_sharded = any(i in sharded for i in n.inputs if i not in weights)
        if weights and _is_lookup(n, classes, by_name) and not reads_sharded:
            kind = TensorShard.VOCAB
        elif weights and _is_product(n, classes):
            kind = TensorShard.ROW if reads_sharded else TensorShard.COLUMN
        else:
            kind = TensorShard.SPLIT if reads_sharded else TensorShard.REPLICATED
        kinds[n.name] = kind
        if kind in (TensorShard.COLUMN, TensorShard.SPLIT):
            sharded.add(n.name)
    return kinds


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterShard:
    """How one parameter is split over a tensor-parallel group: along ``dim``, for the kind of
    product that reads it (COLUMN: output features; ROW: input features, its reader's partial
    sums are reduced; VOCAB: an embedding's rows, its lookups reduced)."""

    kind: TensorShard
    dim: int

    def __post_init__(self) -> None:
        if self.kind not in (TensorShard.COLUMN, TensorShard.ROW, TensorShard.VOCAB) or self.dim < 0:
            raise InputError(f"a parameter is split as a column, row or vocab weight along a dimension >= 0, "
                             f"not {self.kind.value} along {self.dim}")

    @property
    def reduces(self) -> bool:
        """Its reader's output is a sum of partial results across the group (Megatron's ``g``)."""
        return self.kind is not TensorShard.COLUMN


def parameter_shards(nodes: Sequence[NodeCost], classes: Mapping[str, str] | None = None) -> dict[str, ParameterShard]:
    """Which parameters a tensor group splits, found from the graph alone (:func:`shard_kinds`):
    the weight matrices of COLUMN, ROW and VOCAB nodes, and the bias vectors of COLUMN ones. A
    ``linear`` weight is ``(out, in)``: COLUMN splits dimension 0, ROW dimension 1; a weight
    that ``mm``/``addmm``/``matmul`` multiplies from the right is ``(in, out)``: the other way
    round; an embedding's rows are dimension 0. A module call (symbolic_trace's ``nn.Linear``)
    holds ``weight`` and ``bias`` as ``linear`` does (``classes`` as :func:`shard_kinds`). A
    parameter two nodes would split along different dimensions stays whole.

    >>> from pipecut.ir import NodeCost
    >>> from pipecut.core.kinds import NodeOp
    >>> w = lambda n: NodeCost(name=n, op=NodeOp.GET_ATTR, target=n, param_bytes=8, shape=(2, 2), parameters=(n,))
    >>> f = lambda n, t, *i: NodeCost(name=n, op=NodeOp.CALL_FUNCTION, target=t, inputs=i)
    >>> t = [NodeCost(name="x", op=NodeOp.PLACEHOLDER, target="x"), w("w1"), w("w2"),
    ...      f("up", "aten.linear", "x", "w1"), f("act", "gelu", "up"), f("down", "aten.mm", "act", "w2")]
    >>> {k: (v.kind.value, v.dim) for k, v in parameter_shards(t).items()}
    {'w1': ('column', 0), 'w2': ('row', 0)}
    """
    by_name = {n.name: n for n in nodes}
    found: dict[str, set[tuple[TensorShard, int]]] = {}
    for n, kind in shard_kinds(nodes, classes).items():
        if kind not in (TensorShard.COLUMN, TensorShard.ROW, TensorShard.VOCAB):
            continue
        node = by_name[n]
        for fqn, dim in _split_dims(node, kind, by_name):
            found.setdefault(fqn, set()).add((kind, dim))
    out = {}
    for fqn, ways in found.items():
        dims = {d for _, d in ways}
        if len(dims) == 1:  # one dimension: the kind that reduces wins (its reader closes the region)
            kind = max((k for k, _ in ways), key=lambda k: k is not TensorShard.COLUMN)
            out[fqn] = ParameterShard(kind=kind, dim=dims.pop())
    return out


def _split_dims(node: NodeCost, kind: TensorShard, by_name: Mapping[str, NodeCost]) -> list[tuple[str, int]]:
    """(parameter, dimension) pairs ``node`` of ``kind`` splits."""
    if kind is TensorShard.VOCAB:
        return [(p, 0) for w in _weights(node, by_name) for p in by_name[w].parameters[:1]]
    column = kind is TensorShard.COLUMN
    if node.op is NodeOp.CALL_MODULE:  # nn.Linear: weight (out, in), bias (out,)
        return [(p, 0 if column else 1) for p in node.parameters if p.endswith(".weight")] + [
            (p, 0) for p in node.parameters if p.endswith(".bias") and column]
    linear = "linear" in node.target.lower()
    dim = (0 if column else 1) if linear else (1 if column else 0)
    out = []
    for w in _weights(node, by_name):
        if by_name[w].op is NodeOp.GET_ATTR and by_name[w].parameters:
            if not linear and node.inputs.index(w) == 0:
                continue  # a weight on the left of a product: not a layout we split
            out.append((by_name[w].parameters[0], dim))
    if column:  # a bias vector of the product: split with its output features
        out += [(by_name[i].parameters[0], 0) for i in node.inputs
                if by_name[i].op is NodeOp.GET_ATTR and by_name[i].parameters and len(by_name[i].shape or (0, 0)) == 1]
    return out


def residual_stream(nodes: Sequence[NodeCost], kinds: Mapping[str, TensorShard]) -> frozenset[str]:
    """The replicated values on the residual stream: made by a ROW or VOCAB node or from one
    (what sequence parallelism splits along the sequence, and sends across a cut as token
    shards); masks and rotary tables are not."""
    out: set[str] = set()
    for n in nodes:
        k = kinds.get(n.name)
        if k in (TensorShard.ROW, TensorShard.VOCAB) or (
                k is TensorShard.REPLICATED and n.op is not NodeOp.GET_ATTR and any(i in out for i in n.inputs)):
            out.add(n.name)
    return frozenset(out)


def split_work(kinds: Mapping[str, TensorShard], nodes: Sequence[NodeCost], *,
               sequence_parallel: bool) -> frozenset[str]:
    """The nodes whose FLOPs and bytes each GPU of the group does 1/T of: the products and the
    split region; with sequence parallelism the residual stream's norms and adds too."""
    seq = residual_stream(nodes, kinds) - {n for n, k in kinds.items() if k is TensorShard.VOCAB} if sequence_parallel else set()
    return frozenset(n for n, k in kinds.items()
                     if k in (TensorShard.COLUMN, TensorShard.ROW, TensorShard.SPLIT) or n in seq)


def split_outputs(kinds: Mapping[str, TensorShard], nodes: Sequence[NodeCost], *,
                  sequence_parallel: bool) -> frozenset[str]:
    """The nodes whose output (and what autograd keeps of it) each GPU holds 1/T of: sharded
    values; with sequence parallelism the residual stream's values too."""
    seq = residual_stream(nodes, kinds) if sequence_parallel else set()
    return frozenset(n for n, k in kinds.items() if k in (TensorShard.COLUMN, TensorShard.SPLIT) or n in seq)


def collectives(nodes: Sequence[NodeCost], kinds: Mapping[str, TensorShard], tp: int, link: Link, *,
                sequence_parallel: bool, regather: bool = False) -> dict[str, tuple[float, float]]:
    """Per node, the (forward, backward) ms of the group's collectives it waits for, on ``link``
    (a ring of ``tp`` GPUs, the full buffer's bytes from the unsharded table): ``g`` after each
    ROW and VOCAB node; ``f`` on each replicated value that COLUMN nodes read, once however many
    read it (q, k and v share one), charged to the first of them. All-reduce = reduce-scatter +
    all-gather: twice :func:`~pipecut.planning.cluster.stage.ring_ms`. ``regather`` (with
    sequence parallelism): ``f``'s input kept as its shard and all-gathered again in the
    backward, one more all-gather there (:func:`shard_table`)."""
    if tp <= 1:
        return {}
    by_name = {n.name: n for n in nodes}
    half = lambda nbytes: ring_ms(nbytes, tp, link)  # noqa: E731 - one reduce-scatter or all-gather
    out: dict[str, tuple[float, float]] = {}

    def add(name: str, fwd: float, bwd: float) -> None:
        f, b = out.get(name, (0.0, 0.0))
        out[name] = (f + fwd, b + bwd)

    for n in nodes:
        if kinds.get(n.name) in (TensorShard.ROW, TensorShard.VOCAB):  # g
            size = half(n.output_bytes)
            add(n.name, *((size, size) if sequence_parallel else (2 * size, 0.0)))
    for value, reader in gathered_inputs(nodes, kinds).items():  # f, charged to its first reader
        size = half(by_name[value].output_bytes)
        add(reader, *((size, 2 * size if regather else size) if sequence_parallel else (0.0, 2 * size)))
    return out


def gathered_inputs(nodes: Sequence[NodeCost], kinds: Mapping[str, TensorShard]) -> dict[str, str]:
    """The replicated values COLUMN nodes read (``f``'s inputs), each with the first of its
    readers: q, k and v share one; a weight or a bias is not one."""
    by_name = {n.name: n for n in nodes}
    out: dict[str, str] = {}
    for n in nodes:
        if kinds.get(n.name) is TensorShard.COLUMN:
            weights = _weights(n, by_name)
            for i in n.inputs:
                if i not in weights and i not in out and by_name[i].op is not NodeOp.GET_ATTR:
                    out[i] = n.name
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedTable:
    """One GPU's share of a cost table under T-way tensor parallelism."""

    tensor_parallel: int
    sequence_parallel: bool
    nodes: tuple[NodeCost, ...]
    """The cost table as one GPU of the group runs it: times include the collectives."""
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Of those times, the (forward, backward) ms of the group's collectives, by node."""
    kinds: Mapping[str, TensorShard] = field(default_factory=dict)


def shard_table(nodes: Sequence[NodeCost], tp: int, link: Link, *, sequence_parallel: bool,
                times: Mapping[str, tuple[float, float]] | None = None, overlapped: bool = False,
                regather: bool = False) -> ShardedTable:
    """``nodes`` (the full table, one microbatch) as one GPU of a ``tp``-way group runs them.

    ``times``: the (forward, backward) ms of each node of :func:`split_work` at its 1/T share,
    priced by the caller (a product's efficiency depends on its shape); where a node is not
    given, its times are divided by T. Weights read by COLUMN, ROW and VOCAB nodes are divided
    by T; so are the outputs and kept bytes of :func:`split_outputs`. The collectives of
    :func:`collectives` are added to the times of the node they follow; ``overlapped`` (async
    tensor parallelism): only what each takes beyond that node's own product, which hides it.

    With sequence parallelism a column product's input is all-gathered. DTensor's redistribute
    is an op of the graph, so autograd keeps the gathered copy, whole on every GPU (pipecut's
    runtime and torchtitan). ``regather``: the copy is not kept; the shard is, and the backward
    gathers it again (Megatron-LM's and Transformer Engine's column-parallel linears), so its
    saved bytes are divided by T and its backward waits for one more all-gather."""
    kinds = shard_kinds(nodes)
    if tp <= 1:
        return ShardedTable(tensor_parallel=1, sequence_parallel=False, nodes=tuple(nodes), kinds=kinds)
    by_name = {n.name: n for n in nodes}
    work = split_work(kinds, nodes, sequence_parallel=sequence_parallel)
    outs = split_outputs(kinds, nodes, sequence_parallel=sequence_parallel)
    weights = {w for n in nodes if kinds[n.name] in (TensorShard.COLUMN, TensorShard.ROW, TensorShard.VOCAB)
               for w in _weights(n, by_name)}
    comm = collectives(nodes, kinds, tp, link, sequence_parallel=sequence_parallel, regather=regather)
    whole_saved = set(gathered_inputs(nodes, kinds)) if sequence_parallel and not regather else set()
    given = times or {}
    rows = []
    exposed: dict[str, tuple[float, float]] = {}
    for n in nodes:
        fwd, bwd = given.get(n.name, (n.forward_ms / tp, n.backward_ms / tp)) if n.name in work else (
            n.forward_ms, n.backward_ms)
        cf, cb = comm.get(n.name, (0.0, 0.0))
        if overlapped:
            cf, cb = max(0.0, cf - fwd), max(0.0, cb - bwd)
            if n.name in comm:
                exposed[n.name] = (cf, cb)
        changes: dict[str, object] = {"forward_ms": fwd + cf, "backward_ms": bwd + cb}
        if n.name in weights:
            changes["param_bytes"] = math.ceil(n.param_bytes / tp)
        if n.name in outs:
            changes["output_bytes"] = math.ceil(n.output_bytes / tp)
            if n.name in whole_saved:
                changes["saved_bytes"] = n.kept_bytes
            elif n.saved_bytes is not None:
                changes["saved_bytes"] = math.ceil(n.saved_bytes / tp)
            feature = kinds[n.name] in (TensorShard.COLUMN, TensorShard.SPLIT)
            if n.shape is not None:
                changes["shape"] = _split_shape(n.shape, tp, feature=feature)
            changes["leaves"] = tuple(replace(leaf, shape=_split_shape(leaf.shape, tp, feature=feature))
                                      if leaf.kind is LeafKind.TENSOR and leaf.shape else leaf for leaf in n.leaves)
        rows.append(replace(n, **changes))  # type: ignore[arg-type]
    return ShardedTable(tensor_parallel=tp, sequence_parallel=sequence_parallel, nodes=tuple(rows),
                        collectives=exposed if overlapped else comm, kinds=kinds)


def _split_shape(shape: tuple[int, ...], tp: int, *, feature: bool) -> tuple[int, ...]:
    """One GPU's shape of a split value (what crosses a cut is its bytes): features (or heads)
    split on the last dimension, a sequence-parallel value on its tokens
    (:func:`~pipecut.core.shapes.token_dim`); another dimension that T divides where that one
    does not."""
    if not shape:
        return shape
    first = len(shape) - 1 if feature else token_dim(len(shape))
    order = [first] + [i for i in range(len(shape) - 1, -1, -1) if i != first]
    for i in order:
        if shape[i] % tp == 0 and shape[i] >= tp:
            return (*shape[:i], shape[i] // tp, *shape[i + 1:])
    return shape


def sharded_widths(nodes: Sequence[NodeCost], kinds: Mapping[str, TensorShard]) -> tuple[int, ...]:
    """The dimensions a tensor group splits, which T must divide: each COLUMN weight's output
    features and each ROW weight's input features (``get_attr`` weights, whose shapes the table
    records)."""
    by_name = {n.name: n for n in nodes}
    out = set()
    for n in nodes:
        kind = kinds.get(n.name)
        if kind not in (TensorShard.COLUMN, TensorShard.ROW):
            continue
        for w in _weights(n, by_name):
            shape = by_name[w].shape or ()
            if len(shape) >= 2:
                out.add(int(shape[0] if kind is TensorShard.COLUMN else shape[1]))
    return tuple(sorted(out))


def tensor_sizes(gpus_per_node: int, divides: Sequence[int] = ()) -> tuple[int, ...]:
    """The T a node of ``gpus_per_node`` GPUs can run: divisors of it that divide every count of
    ``divides`` (attention heads, KV heads, the split widths), smallest first."""
    return tuple(t for t in range(1, gpus_per_node + 1)
                 if gpus_per_node % t == 0 and all(c % t == 0 for c in divides if c > 0))


def check_tensor_parallel(tp: int, gpus_per_node: int, counts: Mapping[str, int]) -> None:
    """InputError, with the values and the sizes that would run, unless ``tp`` divides the GPUs
    of a node and every named count (``{"attention heads": 64, ...}``)."""
    if tp < 1:
        raise InputError(f"tensor_parallel={tp}: give 'auto' or a size ≥ 1")
    bad = {"GPUs per node": gpus_per_node} if gpus_per_node % tp else {}
    bad.update({name: c for name, c in counts.items() if c > 0 and c % tp})
    if bad:
        fits = tensor_sizes(gpus_per_node, tuple(counts.values()))
        raise InputError(
            f"tensor_parallel={tp} must divide the {' and the '.join(f'{k} ({v})' for k, v in bad.items())}: a "
            f"tensor-parallel group stays inside one node and splits whole heads; sizes that run: "
            f"{', '.join(map(str, fits))} (or 'auto')"
        )


def rank_share(nodes: Sequence[NodeCost], tp: int, link: Link, sequence_parallel: bool = False) -> tuple[NodeCost, ...]:
    """``nodes`` (measured on one device, whole) as one rank of a ``tp``-way group runs them
    under ``compile``: the times of :func:`shard_table` (the
    divided nodes at 1/T, the group's collectives over ``link`` added), the divided weights and
    kept activations at 1/T. Shapes stay whole: the wiring reads them. So do the bytes a split
    region's values send (its regions end inside the stage); with ``sequence_parallel`` the
    residual stream's values cross a cut as token shards, a T-th of their bytes. The regions are
    the graph's (Megatron's pairs); a split given by the model's ``tp_plan`` or the user's may
    differ, which the calibration on the running pipeline corrects for the times."""
    if tp <= 1:
        return tuple(nodes)
    table = shard_table(nodes, tp, link, sequence_parallel=sequence_parallel)
    tokens = residual_stream(nodes, table.kinds) if sequence_parallel else frozenset()
    return tuple(replace(n, forward_ms=s.forward_ms, backward_ms=s.backward_ms, param_bytes=s.param_bytes,
                                     saved_bytes=s.saved_bytes, output_bytes=s.output_bytes if n.name in tokens else n.output_bytes)
                 for n, s in zip(nodes, table.nodes, strict=True))
