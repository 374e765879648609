"""The hybrid planner's view of a model: a chain of units with their costs at the full batch.

Shared by the uniform D × K planner (:mod:`pipecut.passes.parallel.hybrid`) and the per-stage
replication DP (:mod:`pipecut.passes.parallel.replication`). Pure numbers, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipecut.ir import NodeCost
from pipecut.passes.partition.chain import (
    boundary_bytes,
    boundary_messages,
    liveness,
    unit_param_bytes,
)

__all__ = ["Workload", "workload"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """N units in topological order, costs at microbatch size ``B / M``."""

    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    param_bytes: tuple[int, ...]
    """Gradient bytes of each unit (what its stage all-reduces)."""
    activation_bytes: tuple[int, ...] = ()
    """Bytes of each unit's output kept per microbatch until its backward (default 0)."""
    cut_forward_bytes: tuple[int, ...] = ()
    """N + 1 entries: activation bytes crossing the cut before unit b (default 0)."""
    cut_backward_bytes: tuple[int, ...] = ()
    """N + 1 entries: gradient bytes crossing the cut before unit b backwards (default 0)."""
    cut_forward_messages: tuple[int, ...] = ()
    """N + 1 entries: tensors crossing the cut before unit b, each one message (default 1)."""
    cut_backward_messages: tuple[int, ...] = ()
    """N + 1 entries: gradients crossing the cut before unit b backwards (default 1)."""
    crossable: tuple[bool, ...] = ()
    """N + 1 entries: whether every value live at the cut can be sent (default all)."""
    modules: tuple[str, ...] = ()
    """Module path of each unit, for coarsening large graphs at module boundaries."""
    names: tuple[str, ...] = ()
    collective_forward_ms: tuple[float, ...] = ()
    collective_backward_ms: tuple[float, ...] = ()
    """Of each unit's forward_ms and backward_ms, the tensor-parallel collectives it waits for
    (:mod:`pipecut.passes.parallel.tensor`; default none), so that a step can say what they cost."""

    def __post_init__(self) -> None:
        n = len(self.forward_ms)
        for name in ("backward_ms", "param_bytes", "activation_bytes", "modules", "names",
                     "collective_forward_ms", "collective_backward_ms"):
            value = getattr(self, name)
            if (name in ("backward_ms", "param_bytes") or value) and len(value) != n:
                raise ValueError(f"a workload of {n} units needs {n} {name}, got {len(value)}")
        for name in ("cut_forward_bytes", "cut_backward_bytes", "cut_forward_messages",
                     "cut_backward_messages", "crossable"):
            value = getattr(self, name)
            if value and len(value) != n + 1:
                raise ValueError(f"a workload of {n} units needs {n + 1} {name}, got {len(value)}")
        if n == 0:
            raise ValueError("a workload needs at least one unit")

    @property
    def units(self) -> int:
        return len(self.forward_ms)

    @property
    def compute_ms(self) -> float:
        """Forward + backward of one microbatch on one device."""
        return sum(self.forward_ms) + sum(self.backward_ms)


def workload(nodes: Sequence[NodeCost],
             collectives: Mapping[str, tuple[float, float]] | None = None) -> Workload:
    """The hybrid planner's view of a cost table (placeholders and parameters are not units);
    ``collectives``: the (forward, backward) ms of its nodes' times that are tensor-parallel
    collectives (:func:`pipecut.passes.parallel.tensor.shard_table`)."""
    live = liveness(nodes)
    fwd, bwd, allowed = boundary_bytes(nodes, live)
    f_msgs, b_msgs = boundary_messages(nodes, live)
    by_name = {n.name: n for n in nodes}
    units = [by_name[u] for u in live.units]
    params = tuple(unit_param_bytes(u, by_name) for u in units)
    return Workload(
        names=live.units,
        forward_ms=tuple(u.forward_ms for u in units),
        backward_ms=tuple(u.backward_ms for u in units),
        param_bytes=params,
        activation_bytes=tuple(u.kept_bytes for u in units),
        cut_forward_bytes=tuple(fwd),
        cut_backward_bytes=tuple(bwd),
        cut_forward_messages=tuple(f_msgs),
        cut_backward_messages=tuple(b_msgs),
        crossable=tuple(allowed),
        modules=tuple(u.module for u in units),
        collective_forward_ms=tuple(collectives.get(u.name, (0.0, 0.0))[0] for u in units) if collectives else (),
        collective_backward_ms=tuple(collectives.get(u.name, (0.0, 0.0))[1] for u in units) if collectives else (),
    )
