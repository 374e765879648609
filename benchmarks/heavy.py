"""The heavy-head section of the partition benchmark: 32k-vocabulary LMs, head whole and in row pieces.

    .venv/bin/python benchmarks/partition.py --heavy [--out benchmarks/heavy.json]

Each model is captured and profiled once on one microbatch (loss included, on the output row).
For each K, :func:`pipecut.planning.heavy.heavy_chunks` picks the heads above total / K and their piece
count as the planner does; the graph with those pieces is profiled where it changed
(``profile(..., only=new_names(chunks))``), and every node it left alone keeps the first
profile's cost (:func:`pipecut.planning.heavy.merge_costs`), so the two tables differ only
in the head. Both are partitioned by the same DP for 1F1B with 8 microbatches on the default
link; the rows give the slowest stage of each (ms per microbatch, compute plus the stage's
communication), the bound total / K, and the head's share of the total. No calibration: these
are the profiled costs the planner starts from.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipecut.capture import as_planned, capture
from pipecut.core.kinds import ScheduleKind
from pipecut.ir import ChunkedNode, NodeCost
from pipecut.passes.partition.chain import is_unit
from pipecut.passes.partition.solve import DEFAULT_LINK, partition_costs
from pipecut.planning.heavy import heavy_chunks, merge_costs, new_names
from pipecut.profile.nodes import profile

__all__ = ["heavy_main", "heavy_rows"]

MICROBATCHES = 8
BATCH = 16
VOCAB = 32000
KS = (2, 4, 8)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _hf_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return _lm_loss(out[0] if isinstance(out, (tuple, list)) else out["logits"], target)


def models() -> dict[str, Callable[[], tuple]]:
    """name -> build() giving (model, inputs, loss_fn, target) for a full batch."""
    from examples import gpt

    def example(dim: int, layers: int, seq: int) -> Callable[[], tuple]:
        def build() -> tuple:
            return gpt.build(batch_size=BATCH, vocab=VOCAB, dim=dim, heads=4, layers=layers, seq=seq)
        return build

    found: dict[str, Callable[[], tuple]] = {
        "examples/gpt d256 L4 T128 (tied)": example(256, 4, 128),
        "examples/gpt d128 L8 T128 (tied)": example(128, 8, 128),
    }
    try:
        import transformers as tf
    except ImportError:
        return found

    def hf(name: str, cfg: Any, cls: Any) -> None:
        def build() -> tuple:
            torch.manual_seed(0)
            ids = torch.randint(0, VOCAB, (BATCH, 129))
            return cls(cfg), {"input_ids": ids[:, :-1]}, _hf_loss, ids[:, 1:]
        found[name] = build

    hf("hf/gpt2 d256 L4 T128 (tied)", tf.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=128, use_cache=False),
        tf.GPT2LMHeadModel)
    hf("hf/llama d256 L4 T128 (untied)", tf.LlamaConfig(
        num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=128,
        tie_word_embeddings=False, use_cache=False), tf.LlamaForCausalLM)
    return found


def _first(value: Any) -> Any:
    """The first microbatch of a full batch (dim 0)."""
    size = BATCH // MICROBATCHES
    if isinstance(value, dict):
        return {k: v[:size] for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(v[:size] for v in value)
    return value[:size]


def _slowest(nodes: tuple[NodeCost, ...], k: int) -> tuple[float, float, list[int], float]:
    """Slowest stage, predicted step, the stages holding pieces, the slowest stage's comm ms."""
    plan = partition_costs(nodes, devices=k, microbatches=MICROBATCHES, batch_size=BATCH,
                           schedule=ScheduleKind.ONE_F_ONE_B, link=DEFAULT_LINK)
    holding = sorted({s.index for s in plan.stages for n in s.nodes if "_piece" in n})
    slowest = max(range(k), key=lambda i: plan.predicted.stage_ms[i])
    return max(plan.predicted.stage_ms), plan.predicted.step_ms, holding, plan.stages[slowest].comm_ms


def heavy_rows(name: str, build: Callable[[], tuple], repeats: int) -> list[dict[str, Any]]:
    model, inputs, loss_fn, target = build()
    first, first_target = _first(inputs), _first(target)
    captured = capture(model, first)
    flat = captured.flatten_inputs(first)
    start = time.perf_counter()
    nodes = profile(captured, flat, loss_fn=loss_fn, target=first_target, repeats=repeats, warmup=1)
    secs = time.perf_counter() - start
    units = [n for n in nodes if is_unit(n)]
    total = sum(n.forward_ms + n.backward_ms for n in units)
    print(f"profiled {name}: {len(nodes)} nodes in {secs:.1f} s", file=sys.stderr)
    chunked_tables: dict[tuple[ChunkedNode, ...], tuple[NodeCost, ...]] = {}
    rows = []
    for k in KS:
        chunks = heavy_chunks(nodes, k, captured.gm)
        heads = [n for n in units if n.name in {c.node for c in chunks}] or [
            max((n for n in units if n.name != "output"), key=lambda n: n.forward_ms + n.backward_ms)]
        head_ms = sum(n.forward_ms + n.backward_ms for n in heads)
        whole_ms, whole_step, _, whole_comm = _slowest(nodes, k)
        row: dict[str, Any] = {
            "model": name, "k": k, "head": ",".join(n.name for n in heads), "head_ms": head_ms,
            "head_share": head_ms / total, "loss_ms": next(n.forward_ms + n.backward_ms for n in units
                                                           if n.name == "output"),
            "total_ms": total, "bound": total / k, "whole": whole_ms, "whole_step": whole_step,
            "whole_comm": whole_comm, "pieces": 0, "chunked": None, "chunked_step": None,
            "piece_stages": [], "chunked_comm": None,
        }
        if chunks:
            if chunks not in chunked_tables:
                rewritten = as_planned(captured, chunks)
                measured = profile(rewritten, flat, loss_fn=loss_fn, target=first_target,
                                   repeats=repeats, warmup=1, only=new_names(chunks))
                chunked_tables[chunks] = merge_costs(nodes, measured, chunks)
            chunked_ms, chunked_step, holding, comm = _slowest(chunked_tables[chunks], k)
            row.update(pieces=sum(c.pieces for c in chunks), chunked=chunked_ms,
                       chunked_step=chunked_step, piece_stages=holding, chunked_comm=comm)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | K | head share | head ms | loss ms | total / K | slowest, head whole | "
            "pieces | slowest, head in pieces (its comm) | stages with pieces | predicted step "
            "whole → pieces |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        chunked = (f"**{r['chunked']:.1f}** ({r['chunked_comm']:.1f})" if r["chunked"] is not None
                   else "(head not above total / K)")
        steps = (f"{r['whole_step']:.0f}" if r["chunked_step"] is None else
                 f"{r['whole_step']:.0f} → {r['chunked_step']:.0f}")
        lines.append(
            f"| {r['model']} | {r['k']} | {100 * r['head_share']:.0f}% | {r['head_ms']:.1f} | "
            f"{r['loss_ms']:.1f} | {r['bound']:.1f} | {r['whole']:.1f} | {r['pieces'] or '-'} | "
            f"{chunked} | {','.join(map(str, r['piece_stages'])) or '-'} | {steps} |"
        )
    return "\n".join(lines)


def heavy_main(repeats: int, only: str, out: Path | None) -> None:
    rows = []
    for name, build in models().items():
        if not name.startswith(only):
            continue
        try:
            rows += heavy_rows(name, build, repeats)
        except Exception as e:  # a model the capture cannot handle is reported, not fatal
            print(f"skip {name}: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
    print("### Heavy LM heads: whole and in row pieces (1F1B, 8 microbatches; slowest stage, "
          "ms per microbatch)\n")
    print(table(rows))
    if out:
        out.write_text(json.dumps(rows, indent=1))
