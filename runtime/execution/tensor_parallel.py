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
arithmetic on split values is DTensor's: the sharded matmuls, the collectives and their backward.

:class:`TokenWire` carries the token-split residual stream across cuts as it is: each rank
sends its own tokens to the rank of the next stage at its place in the tensor group, which
views them as the same token shard (Megatron's sequence-parallel point-to-point): a T-th of the
bytes on the wire, no all-gather before a send, no rank receiving tokens it does not compute on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from pipecut.core.owned import own_path
from pipecut.core.shapes import token_dim
from pipecut.runtime.comm.wire import TensorLeaf, WireSpec

__all__ = ["RegionEnds", "TokenWire", "region_ends", "shard_module", "whole"]


@dataclasses.dataclass(frozen=True)
class RegionEnds:
    """The conversions :func:`pipecut.passes.rewrite.tensor_regions.shard_regions` inserts (its
    keyword arguments of the same names), bound to a stage's tensor-parallel mesh."""

    enter: Callable[[Any], Any]
    leave: Callable[[Any], Any]
    whole: Callable[[Any], Any]
    join: Callable[[Any], Any] | None = None
    """Sequence parallelism only (None: off)."""


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
        return RegionEnds(enter=replicated, leave=whole, whole=whole)

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

    return RegionEnds(enter=gathered, leave=token_shard, whole=whole, join=replicated)


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
    """A DTensor as the plain tensor of its whole value (collective over its mesh); anything
    else as it is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def shard_module(module: torch.nn.Module, dims: Mapping[str, int], mesh: DeviceMesh,
                 replicated: Collection[str] = ()) -> None:
    """Replace each parameter of ``module`` named in ``dims`` by a DTensor parameter sharded
    along that dimension on ``mesh``, from the whole tensor every rank of the group holds (the
    same on all of them: rank 0's, set by compile's weight sync). A parameter held under two
    names (a tied weight) becomes one DTensor parameter under both. ``replicated``: parameters
    to hold as DTensors replicated over the group, whole on every rank (the bias of a module
    whose weight is split: the module's own forward mixes them, and DTensor mixes no plain tensor
    into a product)."""
    made: dict[int, torch.nn.Parameter] = {}
    owners: dict[str, torch.nn.Module] = {}
    owned: set[int] = set()
    for fqn, p in list(module.named_parameters(remove_duplicate=False)):
        if fqn not in dims and fqn not in replicated:
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
