"""A stage split over a tensor-parallel group: DTensor parameters and the two region ends.

:func:`shard_module` makes each split parameter a DTensor sharded along its dimension (each rank
keeps its own slice of the whole tensor it holds: no communication), the rest stay plain and
whole. :func:`region_ends` gives the conversions that
:func:`pipecut.passes.rewrite.tensor_regions.shard_regions` puts around the split regions:
``enter`` views a plain value as replicated over the group (``DTensor.from_local``: its gradient
is summed over the group in backward) and ``leave`` makes a DTensor whole and plain again
(``full_tensor``: partial sums all-reduced, shards all-gathered). With sequence parallelism
``leave`` cuts a region's value into token shards instead (reduce-scatter), ``enter`` gathers
them, and ``join`` views what the token-split residual stream reads as replicated. All
arithmetic on split values is DTensor's: the sharded matmuls, the collectives and their backward;
but for attention, which :func:`local_heads` runs on each rank's own heads (Megatron's way):
heads are independent, so it needs no collective, and DTensor has no sharding rule for the fused
kernel torch picks on CPU (it propagated through its decomposition for minutes per stage, then
failed on the output's reshape).

:class:`TokenWire` carries the token-split residual stream across cuts as it is: each rank
sends its own tokens to the rank of the next stage at its place in the tensor group, which
views them as the same token shard (Megatron's sequence-parallel point-to-point): a T-th of the
bytes on the wire, no all-gather before a send, no rank receiving tokens it does not compute on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from pipecut.core.owned import own_path
from pipecut.core.shapes import token_dim
from pipecut.core.torch_private import pytree
from pipecut.runtime.comm.wire import TensorLeaf, WireSpec

__all__ = ["AttentionSplitError", "RegionEnds", "TokenWire", "attend_local_heads", "local_heads", "region_ends",
           "shard_module", "whole"]


class AttentionSplitError(RuntimeError):
    """An attention whose query, key and mask disagree on their tokens once split: a token shard
    of the residual stream reached it as if whole (sequence parallelism), which no kernel can
    attend correctly. Raised before the kernel, so that the build's probe refuses it by node."""


@dataclasses.dataclass(frozen=True)
class RegionEnds:
    """The conversions :func:`pipecut.passes.rewrite.tensor_regions.shard_regions` inserts (its
    keyword arguments of the same names), bound to a stage's tensor-parallel mesh."""

    enter: Callable[[Any], Any]
    leave: Callable[[Any], Any]
    whole: Callable[[Any], Any]
    join: Callable[[Any], Any] | None = None
    """Sequence parallelism only (None: off)."""
    heads: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    """An attention op as run on each rank's own heads (:func:`local_heads`)."""


def region_ends(mesh: DeviceMesh, sequence_parallel: bool = False) -> RegionEnds:
    """The region ends over ``mesh``, the stage's 1-D tensor-parallel mesh. With
    ``sequence_parallel`` a region leaves into a token shard (reduce-scatter; all-gather in
    backward) and enters from one by gathering it (all-gather; reduce-scatter in backward):
    Megatron's sequence-parallel ``g`` and its conjugate."""

    def replicated(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x

    if not sequence_parallel:
        return RegionEnds(enter=replicated, leave=whole, whole=whole, heads=local_heads)

    def gathered(x: Any) -> Any:
        if isinstance(x, DTensor) and any(isinstance(p, Shard) for p in x.placements):
            return x.redistribute(mesh, [Replicate()])
        return replicated(x)

    def token_shard(x: Any) -> Any:
        if not isinstance(x, DTensor):
            return x
        if any(p.is_partial() and type(p) is not Partial for p in x.placements):
            # a vocabulary-split embedding's masked sum: the backward of a reduce-scatter cannot
            # return to it (torch 2.13), so it is summed whole first, then cut (once per model)
            x = x.redistribute(mesh, [Replicate()])
        return x.redistribute(mesh, [Shard(token_dim(x.ndim))])

    return RegionEnds(enter=gathered, leave=token_shard, whole=whole, join=replicated, heads=local_heads)


@functools.cache
def local_heads(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op``, a scaled dot-product attention, as :func:`attend_local_heads` runs it (one
    function per op: a graph's call target)."""

    def local_heads_attention(*args: Any, **kwargs: Any) -> Any:
        return attend_local_heads(op, *args, **kwargs)

    return local_heads_attention


def attend_local_heads(op: Callable[..., Any], query: Any, key: Any, value: Any, attn_mask: Any = None,
                       *args: Any, **kwargs: Any) -> Any:
    """``op(query, key, value, attn_mask, ...)``, a scaled dot-product attention, run on each
    rank's own heads where DTensors hold them: query, key and value split alike along one batch
    dimension (the heads of ``(batch, heads, tokens, features)``), evenly, so that grouped-query
    attention keeps its ratio on every rank (4 query heads over 2 key/value heads at T = 2:
    heads 0-1 with 0 on rank 0). The mask is cut alike where it has that dimension whole, else
    read whole. Anything else (a split the region did not expect, or plain tensors) runs on
    whole heads, replicated: correct, not faster. Differentiable: ``to_local``/``from_local``
    carry the gradients without communication."""
    _check_tokens(query, key, attn_mask)
    found = [t for t in (query, key, value) if isinstance(t, DTensor)]
    if not found:
        return op(query, key, value, attn_mask, *args, **kwargs)
    mesh = found[0].device_mesh
    placement = _head_split(query, key, value, mesh.size())

    def local(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        x = t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return x.redistribute(mesh, [placement]).to_local()

    cut_mask = (isinstance(placement, Shard) and isinstance(attn_mask, torch.Tensor)
                and attn_mask.ndim == query.ndim and attn_mask.shape[placement.dim] == query.shape[placement.dim])
    mask = local(attn_mask) if cut_mask else _whole_local(attn_mask)
    out = op(local(query), local(key), local(value), mask, *args, **kwargs)
    return DTensor.from_local(out, mesh, [placement], run_check=False)


def _check_tokens(query: Any, key: Any, attn_mask: Any) -> None:
    """Refuse a mask that does not cover the query's and the key's tokens as this rank holds them
    (DeepSeek-V3's MLA under sequence parallelism: a query of one token shard, 8 of 16 tokens,
    against the whole sequence's causal mask)."""
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.ndim < 2:
        return
    held = tuple(t.to_local().shape[-2] if isinstance(t, DTensor) else t.shape[-2] for t in (query, key))
    mask = tuple(attn_mask.shape[-2:])
    if all(m in (1, n) for m, n in zip(mask, held)):
        return
    raise AttentionSplitError(
        f"attention's mask covers {mask[0]} queries x {mask[1]} keys, but this rank holds {held[0]} queries "
        f"and {held[1]} keys: a token shard reached the attention as if whole")


def _head_split(query: Any, key: Any, value: Any, size: int) -> Shard | Replicate:
    """The split :func:`local_heads` runs on: query, key and value's common ``Shard`` of a batch
    dimension where it divides evenly, else replicated."""
    tensors = (query, key, value)
    if not all(isinstance(t, DTensor) and len(t.placements) == 1 for t in tensors):
        return Replicate()
    first = query.placements[0]
    if (isinstance(first, Shard) and first.dim < query.ndim - 2
            and all(t.placements[0] == first and t.ndim == query.ndim and t.shape[first.dim] % size == 0
                    for t in tensors)):
        return first
    return Replicate()


def _whole_local(x: Any) -> Any:
    """A mask (or any value) as a whole plain tensor."""
    if isinstance(x, DTensor):
        return x.full_tensor()
    return x


@dataclasses.dataclass(frozen=True)
class TokenWire:
    """The cut values of a stage (sent or received, by name) that are token shards on both sides
    of their cut (sequence parallelism): on the wire each tensor leaf of them is this rank's
    shard of its tokens (:func:`~pipecut.core.shapes.token_dim`: ``(batch, tokens, features)``), where the
    group size divides it (as Megatron requires of the sequence); where it does not, or the leaf
    has fewer than two dimensions, the leaf travels whole and is received as replicated. Both
    ends decide from the same spec, so they agree without a handshake."""

    mesh: DeviceMesh
    values: frozenset[str]

    def _token_dim(self, spec: WireSpec, leaf: TensorLeaf) -> int | None:
        """The dimension ``leaf`` travels cut along; None: whole (or not a token value)."""
        if spec.values[leaf.value].name not in self.values or len(leaf.shape) < 2:
            return None
        d = token_dim(len(leaf.shape))
        return d if leaf.shape[d] % self.mesh.size() == 0 else None

    def shape(self, spec: WireSpec, leaf: TensorLeaf) -> tuple[int, ...]:
        """The shape ``leaf`` has on the wire."""
        d = self._token_dim(spec, leaf)
        if d is None:
            return leaf.shape
        return (*leaf.shape[:d], leaf.shape[d] // self.mesh.size(), *leaf.shape[d + 1:])

    def arrive(self, tensors: Sequence[torch.Tensor], spec: WireSpec) -> list[torch.Tensor]:
        """Received tensor leaves (wire shapes) as the values the stage reads: token values as
        DTensors (their shape the spec's), the rest as they came. Differentiable: a received
        leaf's gradient is that of its shard."""
        out = []
        for t, leaf in zip(tensors, spec.tensors):
            if spec.values[leaf.value].name not in self.values:
                out.append(t)
                continue
            d = self._token_dim(spec, leaf)
            placement = Replicate() if d is None else Shard(d)
            out.append(DTensor.from_local(t, self.mesh, [placement], run_check=False))
        return out

    def depart(self, tensors: Sequence[torch.Tensor], spec: WireSpec) -> list[torch.Tensor]:
        """The stage's sent tensor leaves as they go on the wire: token values as this rank's
        shard (a plain tensor there is a replicated value: this rank's tokens of it), whole
        where they are not cut; the rest as they are. Differentiable."""
        out = []
        for t, leaf in zip(tensors, spec.tensors):
            if spec.values[leaf.value].name not in self.values:
                out.append(t)
                continue
            x = t if isinstance(t, DTensor) else DTensor.from_local(t, self.mesh, [Replicate()], run_check=False)
            d = self._token_dim(spec, leaf)
            out.append(x.full_tensor() if d is None else x.redistribute(self.mesh, [Shard(d)]).to_local())
        return out


def whole(x: Any) -> Any:
    """A DTensor as the plain tensor of its whole value (collective over its mesh), and so each
    DTensor inside a tuple or list (a split region's ``chunk`` that a stage returns: Phi-3's
    halves under ZBV, which reached the send as DTensors); anything else as it is."""
    return pytree.tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, x)


def shard_module(module: torch.nn.Module, dims: Mapping[str, int], mesh: DeviceMesh,
                 replicated: Collection[str] = (), made: dict[int, torch.nn.Parameter] | None = None) -> None:
    """Replace each parameter of ``module`` named in ``dims`` by a DTensor parameter sharded
    along that dimension on ``mesh``, from the whole tensor every rank of the group holds (the
    same on all of them: rank 0's, set by compile's weight sync). A parameter held under two
    names (a tied weight) becomes one DTensor parameter under both. ``replicated``: parameters
    to hold as DTensors replicated over the group, whole on every rank (the bias of a module
    whose weight is split: the module's own forward mixes them, and DTensor mixes no plain tensor
    into a product). ``made``: the DTensor parameter already made for each parameter (by id),
    shared by the calls for one rank's stages, so that a parameter two of its stages hold (a
    tied weight whose stages ZBV's V puts on one rank) stays one parameter. A parameter that is
    a DTensor already (the other train/eval mode's program, reading the split mode's parameters)
    is kept as it is."""
    made = {} if made is None else made
    owners: dict[str, torch.nn.Module] = {}
    owned: set[int] = set()
    for fqn, p in list(module.named_parameters(remove_duplicate=False)):
        if fqn not in dims and fqn not in replicated:
            continue
        if isinstance(p, DTensor):
            continue
        if id(p) not in made:
            placement = Shard(dims[fqn]) if fqn in dims else Replicate()
            value = distribute_tensor(p.detach(), mesh, [placement], src_data_rank=None)
            made[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
        owner_name, _, name = fqn.rpartition(".")
        if owner_name not in owners:
            # the stage's own copy: the model and its captured graph keep their tensors
            owners[owner_name] = own_path(module, owner_name, owned)
        setattr(owners[owner_name], name, made[id(p)])
