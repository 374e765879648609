"""A run of a stage's nodes that recomputes in backward: a submodule holding no tensors.

Built by :func:`pipecut.passes.rewrite.segments.checkpoint_segments`. Its code is generated from the
run's nodes and called with ``self`` bound to the stage module, so it reads the stage's own
parameters and buffers by their names: nothing is renamed, nothing is registered twice, and
whatever replaces a parameter later (moving to a device, FSDP's sharded parameters) is what the
segment reads. The stage module is held as a plain attribute, not as a submodule (so it is not
walked twice), and a deep copy of the stage points its segments at the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

__all__ = ["Segment", "torch_checkpoint"]


def torch_checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` under torch's non-reentrant checkpoint: the default way a run recomputes."""
    return checkpoint(fn, *args, use_reentrant=False)


class Segment(torch.nn.Module):
    """One run of a stage's nodes, recomputed in backward. Holds no tensors of its own."""

    _owner: torch.nn.Module
    _graph: fx.Graph

    def __init__(self, owner: torch.nn.Module, graph: fx.Graph, nodes: tuple[str, ...]) -> None:
        super().__init__()
        self.nodes = nodes
        code = fx.GraphModule(owner, graph, "Segment")  # compiles the run's code; then dropped
        object.__setattr__(self, "_run", type(code).forward)  # plain attributes: not submodules
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_graph", graph)
        self.recompute: Callable[..., Any] = torch_checkpoint
        """How the run keeps its tensors for backward: torch's checkpoint, or a runtime's own
        (``pipecut.runtime.execution.held_recompute`` under a split backward)."""

    def interpretable(self) -> fx.GraphModule:
        """The run as a module of its own nodes, reading the stage's tensors (to walk it node
        by node: an error can then name the node inside it)."""
        return fx.GraphModule(self._owner, self._graph, "Segment")

    def forward(self, *args: Any) -> Any:
        return self.recompute(self._run, self._owner, *args)

    def extra_repr(self) -> str:
        return f"{len(self.nodes)} nodes: {self.nodes[0]} .. {self.nodes[-1]}"
