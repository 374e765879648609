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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from pipecut.core.owned import own_path

__all__ = ["RegionEnds", "region_ends", "shard_module", "whole"]


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
        return x.redistribute(mesh, [Shard(max(x.ndim - 2, 0))])  # (batch, tokens, features), (tokens, features)

    return RegionEnds(enter=gathered, leave=token_shard, whole=whole, join=replicated)


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
