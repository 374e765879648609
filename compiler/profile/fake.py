"""Count every node's work on fake tensors: shapes, FLOPs, bytes and saved bytes, no arithmetic.

Estimating costs for a device that is not here needs no value, only what each node would do: the
shapes and dtypes it makes, its FLOPs forward and backward (``FlopCounterMode`` counts them from
shapes), the bytes it moves and what autograd would keep for its backward. :func:`fake_work` runs
the captured graph once, node by node as :mod:`pipecut.profile.nodes` does, but on
``FakeTensor``\\ s: the model's parameters, buffers and tensor constants are rebound to fake
stand-ins (from meta or real tensors alike: nothing is copied) and the inputs and target are
faked too, so a Llama-3.1-405B built on the meta device is counted in seconds on a laptop. Real
values are never made: no real tensor is allocated beyond the model's own.

The rows and work equal those that profiling and :func:`~pipecut.profile.flops.count_work` give
on real tensors (the reference path, kept for that comparison): a fake tensor has the shape,
dtype, strides and storage sharing (views) the real one would have. Each distinct op-on-shapes
(:func:`~pipecut.profile.signature.cost_key`) is counted once: the N identical blocks of a
transformer reuse the first block's FLOPs and bytes node by node, which is exact, since both
depend only on what the key holds (``reuse=False`` counts every node, for the tests).

The count runs where the inputs are (the CPU for meta inputs), whose kernels keep what it keeps. ``gpu=True``
counts what a GPU keeps where the two differ (:class:`~pipecut.profile.saved.GpuDropout`:
dropout's one-byte mask, where the CPU keeps a noise tensor of the input's dtype), for a plan for
a GPU: an H100 estimate of a GPT layer with dropout 0.1 at s 8192 kept 420 sbh on the CPU's
count, where the GPU keeps 354 (docs/clusters.md, "Activation memory against the closed form").

    >>> rows, work = fake_work(captured, flat_inputs, loss_fn=loss_fn, target=target)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.fx as fx

from pipecut.core.graph import canonical_names, mutates_first_arg, target_name
from pipecut.core.kinds import NodeOp
from pipecut.core.meta import input_device, module_tensors, rebind
from pipecut.core.program import Captured
from pipecut.core.torch_private import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    pytree,
)
from pipecut.errors import InputError
from pipecut.ir import NodeCost
from pipecut.profile.flops import NodeWork, loss_work, node_work
from pipecut.profile.nodes import node_row
from pipecut.profile.running import LossFn, NodeRunner, preserved_state
from pipecut.profile.saved import GpuDropout, SavedBytes
from pipecut.profile.signature import cost_key

__all__ = ["fake_work"]


def _fake(mode: FakeTensorMode, device: torch.device, t: torch.Tensor, own: bool = False) -> torch.Tensor:
    """A fake tensor of ``t``'s shape, strides, dtype and ``requires_grad`` on ``device`` (a
    Parameter if ``t`` is one); ``t`` itself is not read. ``own``: contiguous, in a storage of
    its own (a microbatch, which a stage receives as its own tensor, not as a view of the batch)."""
    with mode:
        if own:
            out = torch.empty(tuple(t.shape), dtype=t.dtype, device=device)
        else:
            out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(True) if t.requires_grad else out


@contextlib.contextmanager
def _faked_state(gm: fx.GraphModule, mode: FakeTensorMode, device: torch.device) -> Iterator[None]:
    """Every parameter, buffer and tensor constant of ``gm`` rebound to a fake stand-in inside
    (tied weights stay tied: one stand-in per tensor); the originals are put back on exit."""
    originals = {id(t): t for _, t in module_tensors(gm)}
    fakes = {i: _fake(mode, device, t) for i, t in originals.items()}
    back = {id(fakes[i]): t for i, t in originals.items()}
    rebind(gm, fakes)
    try:
        yield
    finally:
        rebind(gm, back)


@contextlib.contextmanager
def _valueless(node: fx.Node) -> Iterator[None]:
    """An InputError naming ``node`` if it needs values that fake tensors do not have."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise InputError(
            f"node {node.name!r} ({target_name(node)}) needs tensor values to know its output "
            f"({type(e).__name__}), and estimation counts on fake tensors, which have none. "
            f"Estimate with real=True (runs every node here on real tensors, slow for a large "
            f"model), or make the model's shapes depend on input shapes only"
        ) from e


def fake_work(
    captured: Captured,
    inputs: Sequence[Any],
    *,
    loss_fn: LossFn | None = None,
    target: Any = None,
    reuse: bool = True,
    gpu: bool = False,
) -> tuple[tuple[NodeCost, ...], dict[str, NodeWork]]:
    """Rows (no times; shapes, output, parameter and saved bytes) and the FLOPs and bytes of
    every node of ``captured`` on flat placeholder ``inputs`` (real or meta: only their shapes
    are read), as :func:`~pipecut.profile.nodes.profile` and
    :func:`~pipecut.profile.flops.count_work` give them on real tensors. ``gpu``: what a GPU
    keeps for backward (:class:`~pipecut.profile.saved.GpuDropout`), not the CPU."""
    gm = captured.gm
    device = input_device(inputs)  # where a real run would be (CPU for meta inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    inputs, target = pytree.tree_map(
        lambda x: _fake(mode, device, x, own=True) if isinstance(x, torch.Tensor) else x, (inputs, target)
    )
    runner = NodeRunner(gm)
    nodes = list(gm.graph.nodes)
    last_use = {n: i for i, node in enumerate(nodes) for n in node.all_input_nodes}
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    rows: list[NodeCost] = []
    work: dict[str, NodeWork] = {}
    counted: dict[Hashable, NodeWork] = {}
    kernels = GpuDropout() if gpu else contextlib.nullcontext()
    with _faked_state(gm, mode, device), preserved_state(gm), mode, torch.enable_grad(), kernels:
        canonical = canonical_names(gm)
        saved = SavedBytes([*gm.parameters(), *gm.buffers()])
        for i, node in enumerate(nodes):
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            node_cost = NodeWork()
            if node.op == "placeholder":
                value = next(placeholders)
                saved.produced(None, value)
            elif node.op == "get_attr":
                value = runner.call(node, args, kwargs)
                saved.constant(value)
            elif node.op == "output":
                value = args[0]
                if loss_fn is not None:
                    output = captured.unflatten_output(value)
                    node_cost = loss_work(captured, value, loss_fn, target)
                    saved.run(node.name, value, partial(loss_fn, output, target))
            else:
                with _valueless(node):
                    key = cost_key(node, gm, args, kwargs, mutates_first_arg(node, gm)) if reuse else None
                    if key is None or key not in counted:
                        node_cost = node_work(runner, node, gm, args, kwargs)
                        if key is not None:
                            counted[key] = node_cost
                    else:
                        node_cost = counted[key]
                    value = saved.run(node.name, (args, kwargs), partial(runner.call, node, args, kwargs))
            env[node] = value
            work[node.name] = node_cost
            rows.append(node_row(node, value, gm, canonical, 0.0, 0.0))
            for n in node.all_input_nodes:  # free values no later node reads
                if last_use[n] == i and n.op != "output":
                    env.pop(n, None)
        rows = [dataclasses.replace(r, saved_bytes=saved.bytes_of(r.name))
                if r.op is not NodeOp.GET_ATTR else r for r in rows]
    return tuple(rows), work
