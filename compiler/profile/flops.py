"""Count the work of every node of a captured graph: FLOPs and bytes, forward and backward.

The graph is interpreted once on one microbatch (as :mod:`pipecut.profile.nodes` does). Each node runs
under ``torch.utils.flop_counter.FlopCounterMode``, then its backward (``torch.autograd.grad`` of
its output with respect to its floating inputs and parameters) runs under the counter too, so
backward FLOPs are counted, not guessed. The counter knows matrix products, convolutions and
attention; elementwise operations count zero FLOPs and are priced by their bytes instead.

Bytes moved: the tensors a node reads plus the tensors it writes. A node whose output shares
storage with one of its inputs (a view: ``view``, ``transpose``, ``getitem`` of a tuple) moves
nothing. A backward reads the output gradient and the saved inputs and writes the input
gradients: counted as twice the forward bytes when the node has a backward at all.

The loss is a function of several kernels (a cast of the logits to float32, a log-softmax, a
gather), not one op: its bytes are summed op by op, forward and backward (:class:`_OpBytes`).
Counted as one op it read the logits once and was priced 8-12 times too fast on an H200
(benchmarks/gpu_costs.py: a Llama's loss predicted 0.07 ms forward, measured 0.86 ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from pipecut.core.graph import mutates_first_arg, node_parameters
from pipecut.core.meta import input_device, read_by, scratch, substitute
from pipecut.core.program import Captured
from pipecut.core.torch_private import TorchDispatchMode, pytree
from pipecut.profile.running import (
    LossFn,
    NodeRunner,
    check_loss,
    cut,
    detached_leaves,
    preserved_state,
)
from pipecut.profile.saved import storage_key

__all__ = ["NodeWork", "count_work", "loss_work", "moved_bytes", "node_work"]


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeWork:
    forward_flops: int = 0
    backward_flops: int = 0
    forward_bytes: int = 0
    backward_bytes: int = 0


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    if t.device.type == "meta":  # no storage to compare: a view's base stands for it
        return id(t._base if t._base is not None else t)
    try:
        key = storage_key(t)  # a fake tensor's storage object stands for its (absent) data
    except (RuntimeError, NotImplementedError):
        return -1
    return 0 if key is None else key


def moved_bytes(inputs: Any, output: Any) -> int:
    """Bytes read plus bytes written; 0 when every output aliases an input (a view)."""
    ins, outs = _tensors(inputs), _tensors(output)
    seen = {_storage(t) for t in ins}
    written = [t for t in outs if _storage(t) not in seen]
    if not written:
        return 0
    return sum(t.numel() * t.element_size() for t in ins + written)


def _cpu_attention(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))


def _cpu_attention_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))


_CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}
"""The counter knows the CUDA kernels of ``scaled_dot_product_attention`` but not the CPU one
that a model on the CPU (or on fake CPU tensors) runs: the same formulas (non-causal, as
torch's own) for it, so attention is not counted as free."""


def _count(fn: Any, *args: Any) -> tuple[Any, int]:
    with FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as counter:
        value = fn(*args)
    return value, int(counter.get_total_flops())


class _OpBytes(TorchDispatchMode):
    """Sums :func:`moved_bytes` of every op dispatched under it: the traffic of a function made
    of several kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.total += moved_bytes((args, kwargs), out)
        return out


def _count_with_bytes(fn: Any) -> tuple[Any, int, int]:
    """``fn()``'s value, FLOPs and bytes moved, op by op."""
    with _OpBytes() as moved:
        value, flops = _count(fn)
    return value, flops, moved.total


def _backward_work(outputs: Any, wrt: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """FLOPs and bytes moved (op by op) of the backward of ``outputs`` w.r.t. ``wrt``; None when
    there is no backward."""
    outs = [t for t in _tensors(outputs) if t.requires_grad]
    wrt = [t for t in wrt if t.requires_grad]
    if not outs or not wrt:
        return None
    grads = [torch.ones_like(t) for t in outs]
    _, flops, nbytes = _count_with_bytes(lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True))
    return flops, nbytes


def count_work(
    captured: Captured,
    inputs: Sequence[Any],
    *,
    loss_fn: LossFn | None = None,
    target: Any = None,
) -> dict[str, NodeWork]:
    """FLOPs and bytes of every node of ``captured`` on flat placeholder ``inputs``."""
    gm = captured.gm
    runner = NodeRunner(gm)
    env: dict[fx.Node, Any] = {}
    work: dict[str, NodeWork] = {}
    placeholders = iter(inputs)
    device = input_device(inputs)
    with preserved_state(gm), torch.enable_grad():
        for node in gm.graph.nodes:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            if node.op == "placeholder":
                env[node] = next(placeholders)
                work[node.name] = NodeWork()
                continue
            if node.op == "get_attr":
                env[node] = runner.call(node, args, kwargs)
                work[node.name] = NodeWork()
                continue
            if node.op == "output":
                env[node] = args[0]
                work[node.name] = loss_work(captured, args[0], loss_fn, target)
                continue
            with scratch(gm, read_by(node, gm, (args, kwargs)), device) as real:
                args, kwargs = substitute((args, kwargs), real)  # a meta model's node weights
                work[node.name] = node_work(runner, node, gm, args, kwargs)
                value = runner.call(node, args, kwargs)
                env[node] = pytree.tree_map(cut, value) if real else value
    return work


def node_work(runner: NodeRunner, node: fx.Node, gm: fx.GraphModule, args: Any, kwargs: Any) -> NodeWork:
    """FLOPs and bytes of one node, forward and backward, on ``args`` (real or meta tensors)."""
    (dargs, dkwargs), leaves = detached_leaves((args, kwargs), clone=mutates_first_arg(node, gm))
    params: list[torch.Tensor] = [p for _, p in node_parameters(node, gm)]
    out, fwd_flops = _count(runner.call, node, dargs, dkwargs)
    bwd = _backward_work(out, leaves + params)
    bwd_flops = bwd[0] if bwd is not None else None
    fwd_bytes = moved_bytes((args, kwargs, params), out)
    return NodeWork(
        forward_flops=fwd_flops,
        backward_flops=bwd_flops or 0,
        forward_bytes=fwd_bytes,
        backward_bytes=2 * fwd_bytes if bwd_flops is not None else 0,
    )


def loss_work(captured: Captured, value: Any, loss_fn: LossFn | None, target: Any) -> NodeWork:
    if loss_fn is None:
        return NodeWork()
    output, leaves = detached_leaves(captured.unflatten_output(value))
    loss, flops, nbytes = _count_with_bytes(lambda: check_loss(loss_fn(output, target)))
    bwd_flops, bwd_bytes = _backward_work(loss, leaves) or (0, 0)
    return NodeWork(forward_flops=flops, backward_flops=bwd_flops, forward_bytes=nbytes,
                    backward_bytes=bwd_bytes)
