"""The cluster planner's activation memory against the closed form of Korthikanti et al. 2022.

    .venv/bin/python benchmarks/activation_closed_form.py [--out benchmarks/activation_closed_form.json]

"Reducing Activation Recomputation in Large Transformer Models" (§4, Table 2) counts the 16-bit
activations one transformer layer keeps per microbatch of b sequences of s tokens (hidden h, a
heads, T-way tensor parallelism): ``sbh(34 + 5as/h)`` with no parallelism,
``sbh(10 + 24/T + 5as/(hT))`` with tensor parallelism, ``sbh(34 + 5as/h)/T`` with sequence
parallelism too, ``34sbh/T`` with selective recompute (the attention core recomputed; also the
flash-attention figure), ``2sbh`` with full recompute (``/T`` with sequence parallelism); and
1F1B's first stage holds K microbatches of its L/K layers (interleaving over V chunks: times
``1 + (K − 1)/(KV)``).

pipecut's figures come from its own functions, on the path :func:`pipecut.planning.cluster.plan.plan_cluster`
takes: the cost table counted on fake tensors (``estimate_captured``: what autograd saves) with
its rebuilt values marked, one GPU's share of it for T > 1 (``sharded_tables``), its workload and
blocks, and ``stage_work``'s kept bytes of block 1 of a 4-layer model (selective: blocks 1 and 2,
halved: pipecut recomputes every second block); the in-flight counts are ``peak_activations``
over the schedule ``build`` gives, one unit kept per stage and microbatch. Two layers, at
Llama-3.1-8B's width (h 4096, 32 heads): ``paper``, the layer the closed form counts (Megatron's
GPT: LayerNorm, fused QKV, explicit softmax, dropout 0.1 on the probabilities and after each
block, a 4h GELU MLP), and ``llama``, Llama-3.1-8B's own (``examples/llama_meta.py``). The
``explained`` column is the closed form with every difference docs/clusters.md names
("Activation memory against the closed form"); ``residual`` is what is left of pipecut's figure
beyond it: the norms' per-token statistics (a few bytes a token, which the closed form leaves
out). A check of pipecut's model, not a measurement; about half a minute here (the 8B captures).
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # examples.llama_meta

from pipecut.cluster import Layout
from pipecut.core.kinds import DataParallelKind, Recompute, ScheduleKind
from pipecut.ir import NodeCost
from pipecut.passes.costs.workload import Workload, workload
from pipecut.passes.parallel.hybrid import ShapeSkipped
from pipecut.passes.partition.rebuild import mark_rebuilt
from pipecut.planning.cluster.figures import parse_cluster
from pipecut.planning.cluster.run import RunShape, block_of, evaluate_run
from pipecut.planning.cluster.schedule import peak_activations
from pipecut.planning.cluster.stage import stage_work, state_memory
from pipecut.planning.cluster.tables import sharded_tables
from pipecut.profile.devices import Precision, estimate_captured
from pipecut.schedules.format import rank_of
from pipecut.schedules.standard import build

__all__ = ["Arch", "Layer", "closed_form", "closed_in_flight", "cost_rows", "explained", "in_flight",
           "layer_bytes", "main", "slack"]

SEQS, BATCHES, TENSOR = (8192, 4096, 2048), (1, 2), (1, 2, 4, 8)
LAYERS = 4
"""Layers captured: block 1 (and 2, for selective) are measured, away from the model's two ends."""
CLUSTER = "1x8xH100-SXM"
DROPOUT = 0.1


class Arch(enum.Enum):
    PAPER = "paper"
    """Megatron's GPT layer, as Korthikanti et al. count it."""
    LLAMA = "llama"
    """Hugging Face's Llama layer (``examples/llama_meta.py``): RMSNorm, RoPE, GQA, SDPA, SwiGLU."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layer:
    arch: Arch
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    """Llama only (repeated to ``heads`` before attention)."""
    ffn: int = 14336
    """Llama only: SwiGLU's width (the paper layer's MLP is 4h)."""
    vocab: int = 128256
    """Llama only."""


class PaperLayer(nn.Module):
    """The layer of the closed form: every activation its §4.1 counts, none other. The norms'
    names hold "norm": the tensor pass tells a norm module from a product by its name."""

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.register_buffer("causal", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(self.norm1(x)).split(h, dim=2)
        q, k, v = (y.view(b, s, self.heads, d).transpose(1, 2) for y in (q, k, v))
        # the scale and the mask (a buffer) save nothing, as Megatron's fused softmax
        probs = F.dropout(((q @ k.transpose(-2, -1)) * d ** -0.5 + self.causal[:s, :s]).softmax(-1), DROPOUT,
                          self.training)
        x = x + F.dropout(self.proj((probs @ v).transpose(1, 2).reshape(b, s, h)), DROPOUT, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x)))), DROPOUT, self.training)


class PaperStack(nn.Module):
    def __init__(self, layer: Layer, seq: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PaperLayer(layer.hidden, layer.heads, seq) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def cost_rows(layer: Layer, seq: int, batch: int, layers: int = LAYERS) -> tuple[NodeCost, ...]:
    """The cost table ``plan_cluster`` counts for one microbatch (fake tensors, bf16, an H100), its
    rebuilt values marked. The paper layers take hidden states; Llama takes tokens and its loss."""
    if layer.arch is Arch.PAPER:
        with torch.device("meta"):
            model: Any = PaperStack(layer, seq).to(torch.bfloat16)
            inputs: Any = (torch.zeros(batch, seq, layer.hidden, dtype=torch.bfloat16, requires_grad=True),)
        loss_fn = target = None
    else:
        from examples.llama_meta import build as llama

        model, inputs, loss_fn, target = llama(
            "8b", batch_size=batch, seq=seq, num_hidden_layers=layers, hidden_size=layer.hidden,
            num_attention_heads=layer.heads, num_key_value_heads=layer.kv_heads, intermediate_size=layer.ffn,
            vocab_size=layer.vocab)
    _, rows = estimate_captured(model, inputs, "H100-SXM", precision=Precision.BF16, loss_fn=loss_fn, target=target)
    return mark_rebuilt(rows, parse_cluster(CLUSTER).intra)


def _work(rows: Sequence[NodeCost], t: int, sequence_parallel: bool) -> Workload:
    """One GPU's workload of a ``t``-way group, as ``predict_run`` builds it."""
    if t == 1:
        return workload(rows)
    table = sharded_tables(rows, (t,), parse_cluster(CLUSTER), sequence_parallel=sequence_parallel)[t]
    return workload(table.nodes, table.collectives)


def layer_bytes(rows: Sequence[NodeCost], t: int, sequence_parallel: bool, recompute: Recompute) -> float:
    """pipecut's activation bytes per layer and microbatch on one GPU of a ``t``-way group."""
    work = _work(rows, t, sequence_parallel)
    blocks = block_of(work.modules)
    starts = [blocks.index(i) for i in (1, 2, 3)]
    assert set(blocks[starts[0]:starts[2]]) == {1, 2}, "blocks 1 and 2 are not contiguous units"
    if recompute is Recompute.SELECTIVE:  # block 1 recomputed, block 2 kept
        return stage_work(work, blocks, starts[0], starts[2], 1, recompute).kept_bytes / 2
    return stage_work(work, blocks, starts[0], starts[1], 1, recompute).kept_bytes


def closed_form(layer: Layer, seq: int, batch: int, t: int, sequence_parallel: bool, recompute: Recompute) -> float:
    """Korthikanti et al.'s bytes per layer and microbatch (Table 2)."""
    sbh = seq * batch * layer.hidden
    if recompute is Recompute.FULL:
        return 2 * sbh / (t if sequence_parallel else 1)
    core = 0.0 if recompute is Recompute.SELECTIVE else 5 * layer.heads * seq / layer.hidden
    if t == 1 or sequence_parallel:
        return sbh * (34 + core) / t
    return sbh * (10 + 24 / t + core / t)


def explained(layer: Layer, seq: int, batch: int, t: int, sp: bool, recompute: Recompute) -> float:
    """The bytes pipecut should count per layer and microbatch: the closed form's method with the
    terms docs/clusters.md names (pipecut's selective: every second layer whole, every other one
    its input)."""
    if recompute is Recompute.SELECTIVE:
        return (explained(layer, seq, batch, t, sp, Recompute.NONE) + explained(layer, seq, batch, t, sp, Recompute.FULL)) / 2
    sp = sp and t > 1
    sbh, asb, bss = seq * batch * layer.hidden, layer.heads * seq * batch, batch * seq * seq
    tokens = t if sp else 1  # what sequence parallelism splits (norms, residual stream, their dropouts)
    if recompute is Recompute.FULL:  # the layer's input, on the residual stream
        return 2 * sbh / tokens
    if layer.arch is Arch.PAPER:  # its dropouts keep a bool mask each, as the closed form counts
        gathered = 4 * sbh * (1 - 1 / t) if sp else 0.0  # the norms' outputs, all-gathered, kept whole
        return closed_form(layer, seq, batch, t, sp, recompute) + gathered
    norms = 2 * (6 * sbh / tokens + 2 * sbh)  # fp32 input and bf16 normalised copies; output whole
    attention = (8 * sbh + 4 * asb + 2 * bss) / t  # q, k, v at all heads, output; fp32 LSE; the bf16 mask
    return norms + attention + 8 * seq * batch * layer.ffn / t  # SwiGLU: gate, its SiLU, up, product


def slack(seq: int, batch: int) -> int:
    """What ``explained`` leaves out: the two norms' per-token statistics (mean and rstd, at most
    8 bytes a token each) and shard_table's rounding up (a byte a node)."""
    return 16 * seq * batch + 512


def in_flight(kind: ScheduleKind, ranks: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Per rank, the stage-microbatches kept at its activation peak, as the planner walks the
    schedule (``peak_activations`` over ``build``, one unit kept per stage and microbatch)."""
    n = ranks * chunks
    shares = peak_activations(build(kind, ranks, microbatches, chunks), [1.0] * n, [0.0] * n, [0.0] * n)
    per = [0.0] * ranks
    for s, x in enumerate(shares):
        per[rank_of(s, ranks, kind.placement)] += x
    return tuple(round(x) for x in per)


def closed_in_flight(ranks: int, chunks: int = 1) -> float:
    """Korthikanti et al.'s first stage, in stage-microbatches: K (1F1B), V·K·(1 + (K − 1)/(K·V))
    interleaved."""
    return ranks * chunks * (1 + (ranks - 1) / (ranks * chunks)) if chunks > 1 else ranks


def first_rank(rows: Sequence[NodeCost], ranks: int, microbatches: int, chunks: int, recompute: Recompute,
               seq: int) -> float:
    """The planner's activation bytes on rank 0 (``evaluate_run``, DDP, one replica, T = 1), its
    V·K stages split evenly by blocks: embedding and head on the end stages."""
    work = _work(rows, 1, False)
    blocks = block_of(work.modules)
    count = max(blocks) + 1
    per = count // (ranks * chunks)
    bounds = (0, *(blocks.index(i * per) for i in range(1, ranks * chunks)), work.units)
    kind = ScheduleKind.INTERLEAVED_1F1B if chunks > 1 else ScheduleKind.ONE_F_ONE_B
    shape = RunShape(batch_size=microbatches, microbatches=microbatches, tokens_per_sample=seq,
                     model_flops_per_token=1.0, schedule=kind, stages_per_rank=chunks, recompute=recompute,
                     sharding=DataParallelKind.DDP)
    run = evaluate_run(work, blocks, shape, parse_cluster(f"1x{ranks}xH100-SXM"), replicas=1, stages=ranks,
                       layout=Layout.STAGES_INSIDE_NODES, splits={(1, ranks * chunks): bounds})
    assert not isinstance(run, ShapeSkipped), run.reason
    mine = [s for s in range(ranks * chunks) if rank_of(s, ranks, kind.placement) == 0]
    return sum(run.stages[s].memory_bytes - state_memory(
        stage_work(work, blocks, bounds[s], bounds[s + 1], 1, recompute), replicas=1, ranks=ranks,
        sharding=DataParallelKind.DDP, param_dtype_bytes=2) for s in mine)


def _layer_rows(layer: Layer, name: str) -> list[dict[str, Any]]:
    out = []
    for seq in SEQS:
        for batch in BATCHES:
            rows, sbh = cost_rows(layer, seq, batch), seq * batch * layer.hidden
            for t in TENSOR:
                for sp in (False,) if t == 1 else (False, True):
                    for rec in Recompute:
                        got, paper = layer_bytes(rows, t, sp, rec), closed_form(layer, seq, batch, t, sp, rec)
                        want = explained(layer, seq, batch, t, sp, rec)
                        out.append({"layer": name, "seq": seq, "batch": batch, "tensor_parallel": t,
                                    "sequence_parallel": sp, "recompute": rec.value, "pipecut_bytes": round(got),
                                    "closed_form_bytes": round(paper), "explained_bytes": round(want),
                                    "pipecut_sbh": round(got / sbh, 4), "closed_form_sbh": round(paper / sbh, 4),
                                    "ratio": round(got / paper, 4), "residual": round((got - want) / got, 6)})
    return out


def _flight_rows() -> list[dict[str, Any]]:
    out = []
    for k in (2, 4, 8):
        for v in (1, 2, 4):
            for m in sorted({k // 2 if v == 1 else k, k, 4 * k}):
                kind = ScheduleKind.ONE_F_ONE_B if v == 1 else ScheduleKind.INTERLEAVED_1F1B
                got = in_flight(kind, k, m, v)
                out.append({"schedule": kind.value, "ranks": k, "chunks": v, "microbatches": m, "pipecut": list(got),
                            "closed_form_rank0": closed_in_flight(k, v),
                            "layers_worth_pipecut": round(got[0] / (k * v), 4),
                            "layers_worth_closed_form": round(closed_in_flight(k, v) / (k * v), 4)})
    return out


def _first_rank_rows() -> list[dict[str, Any]]:
    seq, layers, layer = 4096, 8, Layer(arch=Arch.LLAMA)
    rows, out = cost_rows(layer, seq, 1, layers), []
    for rec in (Recompute.NONE, Recompute.SELECTIVE):
        for k, v in ((4, 1), (2, 1), (2, 2)):
            got = first_rank(rows, k, 8, v, rec, seq)
            flight = in_flight(ScheduleKind.INTERLEAVED_1F1B if v > 1 else ScheduleKind.ONE_F_ONE_B, k, 8, v)[0]
            per_layer = layer_bytes(rows, 1, False, rec)
            product = per_layer * layers * flight / (k * v)
            out.append({"layers": layers, "seq": seq, "batch": 1, "ranks": k, "chunks": v, "microbatches": 8,
                        "recompute": rec.value, "planner_rank0_bytes": round(got),
                        "per_layer_x_in_flight_bytes": round(product), "ratio": round(got / product, 4),
                        "closed_form_bytes": round(closed_form(layer, seq, 1, 1, False, rec) * layers * flight / (k * v))})
    return out


def main(argv: list[str] | None = None) -> int:  # pragma: no cover
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).with_name("activation_closed_form.json")))
    args = ap.parse_args(argv)
    rows = _layer_rows(Layer(arch=Arch.PAPER), "paper") + _layer_rows(Layer(arch=Arch.LLAMA), "llama-8b")
    print("per layer and microbatch, bytes / (s·b·h); residual: (pipecut − explained) / pipecut")
    print(f"{'layer':9} {'s':>5} {'b':>2} {'T':>2} {'SP':>3} {'recompute':10} {'pipecut':>9} {'closed':>9} "
          f"{'ratio':>7} {'residual':>9}")
    for r in rows:
        print(f"{r['layer']:9} {r['seq']:5} {r['batch']:2} {r['tensor_parallel']:2} {'yes' if r['sequence_parallel'] else '':>3} "
              f"{r['recompute']:10} {r['pipecut_sbh']:9.3f} {r['closed_form_sbh']:9.3f} {r['ratio']:7.3f} {r['residual']:9.2e}")
    flights = _flight_rows()
    print("\nin flight at rank 0's peak (stage-microbatches), and in layers' worth of the model")
    print(f"{'schedule':17} {'K':>2} {'V':>2} {'M':>3} {'pipecut (per rank)':30} {'closed':>6} {'layers':>7} {'closed':>7}")
    for f in flights:
        print(f"{f['schedule']:17} {f['ranks']:2} {f['chunks']:2} {f['microbatches']:3} {f['pipecut']!s:30} "
              f"{f['closed_form_rank0']:6g} {f['layers_worth_pipecut']:7.3f} {f['layers_worth_closed_form']:7.3f}")
    first = _first_rank_rows()
    print("\nrank 0 of Llama-8B's shape with 8 layers, s 4096, b 1, M 8: the planner's walk against per layer × in flight")
    for f in first:
        print(f"K {f['ranks']} V {f['chunks']} {f['recompute']:10} planner {f['planner_rank0_bytes'] / 2**30:7.3f} GiB, "
              f"per layer x in flight {f['per_layer_x_in_flight_bytes'] / 2**30:7.3f} GiB (x{f['ratio']:.3f}), "
              f"closed form {f['closed_form_bytes'] / 2**30:7.3f} GiB")
    Path(args.out).write_text(json.dumps({"layers": rows, "in_flight": flights, "first_rank": first,
                                          "torch": torch.__version__},
                                         indent=2, sort_keys=True) + "\n")
    worst = max(abs(r["residual"]) for r in rows)
    print(f"\nworst |residual| {worst:.2e}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
