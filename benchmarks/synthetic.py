"""Synthetic cost tables shaped like a decoder-only transformer, for scale tests and benchmarks.

A real 48-layer model captured op by op (as ``torch.export`` decomposes it) has ten thousand
nodes or more; profiling one on this machine takes minutes. This generator writes a cost table of
the same shape in milliseconds: per layer a layer norm, attention (q/k/v, scores, softmax,
output projection), a residual add, a second layer norm, an MLP and another residual add, with
the elementwise ops of the decompositions padded out to ``nodes_per_layer``. Times follow a
simple flop/byte model with seeded noise, so every call with the same arguments returns the same
table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipecut.core.kinds import LeafKind, NodeOp
from pipecut.ir import Leaf, NodeCost

__all__ = ["Shape", "transformer_costs"]

_GFLOPS_PER_MS = 0.05
"""50 GFLOP/s: the order of a CPU core pair."""
_BYTES_PER_MS = 5e6
"""5 GB/s of memory bandwidth for elementwise ops."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    batch: int = 2
    seq: int = 128
    dim: int = 256
    vocab: int = 8192
    dtype_bytes: int = 4


class _Builder:
    def __init__(self, shape: Shape, seed: int) -> None:
        self.shape = shape
        self.rng = random.Random(seed)
        self.nodes: list[NodeCost] = []

    def add(
        self,
        name: str,
        op: NodeOp,
        module: str,
        inputs: tuple[str, ...],
        *,
        out: tuple[int, ...],
        flops: float = 0.0,
        params: int = 0,
        param_names: tuple[str, ...] = (),
        grad: bool = True,
    ) -> str:
        numel = 1
        for d in out:
            numel *= d
        nbytes = numel * self.shape.dtype_bytes
        if op in (NodeOp.PLACEHOLDER, NodeOp.GET_ATTR, NodeOp.OUTPUT):
            fwd = bwd = 0.0
        else:
            base = flops / 1e9 / _GFLOPS_PER_MS if flops else 2 * nbytes / _BYTES_PER_MS
            fwd = base * self.rng.uniform(0.8, 1.25)
            bwd = fwd * (2.0 if flops else 1.0) * self.rng.uniform(0.9, 1.1)
        leaf = Leaf(kind=LeafKind.TENSOR, shape=out, dtype="float32", requires_grad=grad)
        self.nodes.append(
            NodeCost(
                name=name,
                op=op,
                target=name.split("_")[0],
                module=module,
                inputs=inputs,
                forward_ms=fwd,
                backward_ms=bwd,
                output_bytes=0 if op is NodeOp.OUTPUT else nbytes,
                param_bytes=params,
                parameters=param_names,
                shape=out,
                dtype="float32",
                leaves=(leaf,),
                treespec="leaf",
            )
        )
        return name

    def linear(self, name: str, module: str, x: str, din: int, dout: int) -> str:
        b, t = self.shape.batch, self.shape.seq
        params = (din * dout + dout) * self.shape.dtype_bytes
        return self.add(
            name,
            NodeOp.CALL_MODULE,
            module,
            (x,),
            out=(b, t, dout),
            flops=2.0 * b * t * din * dout,
            params=params,
            param_names=(f"{module}.weight", f"{module}.bias"),
        )

    def chain(self, prefix: str, module: str, x: str, count: int, out: tuple[int, ...]) -> str:
        """``count`` elementwise ops, each reading the previous one (a decomposed norm or GELU)."""
        for i in range(count):
            x = self.add(f"{prefix}_{i}", NodeOp.CALL_FUNCTION, module, (x,), out=out)
        return x


def transformer_costs(
    layers: int = 48, *, nodes_per_layer: int = 210, shape: Shape | None = None, seed: int = 0
) -> tuple[NodeCost, ...]:
    """A cost table of ``layers * nodes_per_layer + 8`` nodes in topological order."""
    if nodes_per_layer < 40:
        raise ValueError(
            f"nodes_per_layer must be at least 40 to fit a layer, got {nodes_per_layer}"
        )
    sh = shape or Shape()
    g = _Builder(sh, seed)
    b, t, d = sh.batch, sh.seq, sh.dim
    act = (b, t, d)
    tokens = g.add("tokens", NodeOp.PLACEHOLDER, "", (), out=(b, t), grad=False)
    emb = g.add(
        "embed",
        NodeOp.CALL_MODULE,
        "wte",
        (tokens,),
        out=act,
        params=sh.vocab * d * sh.dtype_bytes,
        param_names=("wte.weight",),
    )
    x = emb
    pad = nodes_per_layer - 27  # the fixed ops of a layer; the rest are norm/GELU elementwise
    norm_ops, gelu_ops = pad // 4, pad - 2 * (pad // 4)
    for layer in range(layers):
        m = f"h.{layer}"
        p = f"h{layer}"
        y = g.chain(f"{p}_ln1", f"{m}.ln_1", x, norm_ops, act)
        qkv = g.linear(f"{p}_qkv", f"{m}.attn.c_attn", y, d, 3 * d)
        parts = []
        for name in ("q", "k", "v"):
            v = g.add(f"{p}_{name}", NodeOp.CALL_FUNCTION, f"{m}.attn", (qkv,), out=act)
            v = g.add(f"{p}_{name}view", NodeOp.CALL_METHOD, f"{m}.attn", (v,), out=act)
            parts.append(g.add(f"{p}_{name}t", NodeOp.CALL_METHOD, f"{m}.attn", (v,), out=act))
        q, k, v = parts
        scores = (b, 4, t, t)
        att = g.add(
            f"{p}_scores",
            NodeOp.CALL_FUNCTION,
            f"{m}.attn",
            (q, k),
            out=scores,
            flops=2.0 * b * t * t * d,
        )
        att = g.chain(f"{p}_softmax", f"{m}.attn", att, 6, scores)
        y = g.add(
            f"{p}_attv",
            NodeOp.CALL_FUNCTION,
            f"{m}.attn",
            (att, v),
            out=act,
            flops=2.0 * b * t * t * d,
        )
        y = g.chain(f"{p}_merge", f"{m}.attn", y, 3, act)
        y = g.linear(f"{p}_proj", f"{m}.attn.c_proj", y, d, d)
        x = g.add(f"{p}_add1", NodeOp.CALL_FUNCTION, m, (x, y), out=act)
        y = g.chain(f"{p}_ln2", f"{m}.ln_2", x, norm_ops, act)
        y = g.linear(f"{p}_fc", f"{m}.mlp.c_fc", y, d, 4 * d)
        y = g.chain(f"{p}_gelu", f"{m}.mlp.act", y, gelu_ops, (b, t, 4 * d))
        y = g.linear(f"{p}_fc2", f"{m}.mlp.c_proj", y, 4 * d, d)
        x = g.add(f"{p}_add2", NodeOp.CALL_FUNCTION, m, (f"{p}_add1", y), out=act)
    x = g.chain("lnf", "ln_f", x, 4, act)
    logits = g.linear("lm_head", "lm_head", x, d, sh.vocab)
    g.add("output", NodeOp.OUTPUT, "", (logits,), out=(b, t, sh.vocab))
    return tuple(g.nodes)
