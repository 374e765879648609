"""Published training runs pipecut's cluster model is checked against, and a stand-in cost table.

``RUNS`` are data: each run's configuration and its published figure, with the source. The
benchmark (``benchmarks/cluster.py``) and the unit test (``tests/unit/test_published_runs.py``)
predict each with :func:`pipecut.planning.cluster.choose.predict_run`.

Runs are priced with :func:`estimated_rows`: :func:`pipecut.estimate_costs` on a meta Llama
(fake tensors, about 15 s for 8B at 16 x 8192 tokens). ``llama_rows`` writes the same kind of
rows by hand from the Llama shapes (a cross-check, ``benchmarks/cluster.py --rows standin``, and
the 48-layer model of the GPipe row), priced with the estimator's own roofline
(:func:`pipecut.profile.devices.estimate_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipecut.core.kinds import LeafKind, NodeOp
from pipecut.ir import Leaf, NodeCost
from pipecut.profile.devices import Precision, device_profile, estimate_rows
from pipecut.profile.flops import NodeWork

_TENSOR = '[1, {"type": null, "context": null, "children_spec": []}]'
"""The treespec of a node whose value is one tensor (what capture records)."""

__all__ = ["GPIPE_SPEEDUP", "LLAMA", "RUNS", "LlamaDims", "PublishedRun", "estimated_rows", "llama_rows"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaDims:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128256


LLAMA = {
    "llama3-8b": LlamaDims(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8),
    "llama3-70b": LlamaDims(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishedRun:
    name: str
    model: str
    cluster: str
    local_batch: int
    seq: int
    recompute: str
    tokens_per_s_per_gpu: float
    memory_gib: float | None
    source: str
    fitted: bool = False
    """The run the device family's compute efficiency was fitted on (the others are checks)."""


_H100 = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 9dec370, Dec 2024), "
         "FSDP without torch.compile or Float8")
_A100 = "torchtitan docs/performance.md (commit 1ea476e), FSDP2 on 64 A100 80GB"

RUNS = (
    PublishedRun(name="8B FSDP 8xH100", model="llama3-8b", cluster="1x8xH100-SXM-96GB",
                 local_batch=2, seq=8192, recompute="selective", tokens_per_s_per_gpu=5762,
                 memory_gib=82.4, source=f"{_H100}, Table 1", fitted=True),
    PublishedRun(name="8B FSDP 128xH100", model="llama3-8b", cluster="16x8xH100-SXM-96GB",
                 local_batch=2, seq=8192, recompute="selective", tokens_per_s_per_gpu=5605,
                 memory_gib=67.0, source=f"{_H100}, Table 3"),
    PublishedRun(name="8B FSDP 64xA100", model="llama3-8b", cluster="8x8xA100-80GB",
                 local_batch=1, seq=8192, recompute="selective", tokens_per_s_per_gpu=2904,
                 memory_gib=None, source=f"{_A100}: selective layer AC, 56.8% MFU", fitted=True),
    PublishedRun(name="70B FSDP 64xA100", model="llama3-70b", cluster="8x8xA100-80GB",
                 local_batch=1, seq=8192, recompute="full", tokens_per_s_per_gpu=331,
                 memory_gib=None, source=f"{_A100}: full AC, 51.7% MFU"),
)

GPIPE_SPEEDUP = (3.5, "GPipe (Huang et al., 2019), Section 4: a 48-layer Transformer gets 3.5x "
                      "the throughput on 4x the accelerators, K = 2 -> 8 partitions, M = 32")


def estimated_rows(run: PublishedRun, dims: LlamaDims, *, efficiency: float | None = None) -> tuple[NodeCost, ...]:
    """The cost table of the run's Llama from :func:`pipecut.estimate_costs` on meta (fake
    tensors, no arithmetic); ``efficiency`` replaces the family's. Without the loss: with
    torchtitan's fp32 cross entropy the 8-GPU H100 run is predicted at 95 GiB against the 82.4
    GiB measured (the fp32 logits, 7.8 GiB, are counted on top of an estimate already 6% high)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipecut import estimate_costs
    from pipecut.planning.cluster.figures import family_efficiency, family_model, parse_cluster
    from pipecut.profile.devices import device_profile

    cluster = parse_cluster(run.cluster)
    cfg = LlamaConfig(hidden_size=dims.hidden, intermediate_size=dims.ffn, num_hidden_layers=dims.layers,
                      num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
                      vocab_size=dims.vocab, max_position_embeddings=run.seq, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(run.local_batch * cluster.gpus, run.seq, dtype=torch.long, device="meta")
    eff = efficiency if efficiency is not None else family_efficiency(device_profile(cluster.device))[0]
    return estimate_costs(model, {"input_ids": ids}, cluster.device, precision="bf16",
                          compute_efficiency=eff,
                          cost_model=family_model(device_profile(cluster.device), residual=efficiency))


def llama_rows(dims: LlamaDims, *, samples: int, seq: int, device: str,
               compute_efficiency: float) -> tuple[NodeCost, ...]:
    """A bf16 Llama's cost table for ``samples`` × ``seq`` tokens, priced for ``device``."""
    x, d, f, t = samples * seq, dims.hidden, dims.ffn, seq
    kv = dims.kv_heads * d // dims.heads
    rows: list[NodeCost] = []
    work: dict[str, NodeWork] = {}
    prev = "input_ids"
    rows.append(NodeCost(name="input_ids", op=NodeOp.PLACEHOLDER, target="input_ids",
                         output_bytes=8 * x, shape=(samples, seq), dtype="torch.int64"))

    def add(name: str, module: str, target: str, *, out: int, saved: int, flops: float = 0,
            params: int = 0, moved: int = 0, bwd_flops_factor: float = 2.0) -> None:
        nonlocal prev
        inputs = (prev,)
        if params:
            rows.append(NodeCost(name=f"{name}_weight", op=NodeOp.GET_ATTR, target=f"{module}.weight",
                                 module=module, param_bytes=2 * params, parameters=(f"{module}.weight",)))
            inputs = (f"{name}_weight", prev)
        width = max(1, out // (2 * x))
        rows.append(NodeCost(name=name, op=NodeOp.CALL_FUNCTION, target=target, module=module,
                             inputs=inputs, output_bytes=out, saved_bytes=saved,
                             shape=(samples, seq, width), dtype="bfloat16", treespec=_TENSOR,
                             leaves=(Leaf(kind=LeafKind.TENSOR, shape=(samples, seq, width),
                                          dtype="bfloat16", requires_grad=True),)))
        work[name] = NodeWork(forward_flops=int(flops), backward_flops=int(bwd_flops_factor * flops),
                              forward_bytes=moved or 2 * out, backward_bytes=2 * (moved or 2 * out))
        prev = name

    b2 = 2  # bf16
    add("embedding", "model.embed_tokens", "torch.ops.aten.embedding.default",
        out=b2 * x * d, saved=0, params=dims.vocab * d)
    for i in range(dims.layers):
        m = f"model.layers.{i}"
        add(f"l{i}_attn_norm", f"{m}.input_layernorm", "rms_norm", out=b2 * x * d, saved=b2 * x * d, params=d)
        add(f"l{i}_qkv", f"{m}.self_attn.qkv_proj", "linear", out=b2 * x * (d + 2 * kv),
            saved=b2 * x * d, flops=2 * x * d * (d + 2 * kv), params=d * (d + 2 * kv))
        add(f"l{i}_rope", f"{m}.self_attn", "rotary", out=b2 * x * (d + 2 * kv), saved=0)
        # causal flash attention: QK^T and PV over half the token pairs; backward 2.5x forward
        add(f"l{i}_sdpa", f"{m}.self_attn", "scaled_dot_product_attention", out=b2 * x * d,
            saved=b2 * x * (2 * d + 2 * kv) + 4 * x * dims.heads, flops=2 * x * t * d,
            bwd_flops_factor=2.5, moved=b2 * x * (2 * d + 2 * kv))
        add(f"l{i}_o", f"{m}.self_attn.o_proj", "linear", out=b2 * x * d, saved=b2 * x * d,
            flops=2 * x * d * d, params=d * d)
        add(f"l{i}_add1", m, "add", out=b2 * x * d, saved=0)
        add(f"l{i}_mlp_norm", f"{m}.post_attention_layernorm", "rms_norm", out=b2 * x * d,
            saved=b2 * x * d, params=d)
        add(f"l{i}_gate_up", f"{m}.mlp.gate_up_proj", "linear", out=b2 * x * 2 * f, saved=b2 * x * d,
            flops=4 * x * d * f, params=2 * d * f)
        add(f"l{i}_silu_mul", f"{m}.mlp", "silu_mul", out=b2 * x * f, saved=b2 * x * 2 * f)
        add(f"l{i}_down", f"{m}.mlp.down_proj", "linear", out=b2 * x * d, saved=b2 * x * f,
            flops=2 * x * f * d, params=f * d)
        add(f"l{i}_add2", m, "add", out=b2 * x * d, saved=0)
    add("norm", "model.norm", "rms_norm", out=b2 * x * d, saved=b2 * x * d, params=d)
    add("lm_head", "lm_head", "linear", out=b2 * x * dims.vocab, saved=b2 * x * d,
        flops=2 * x * d * dims.vocab, params=dims.vocab * d)
    # cross-entropy on fp32 logits (torchtitan: pred.float()): the fp32 copy and its log-softmax
    add("loss", "", "cross_entropy", out=4, saved=2 * 4 * x * dims.vocab, moved=3 * 4 * x * dims.vocab)
    rows.append(NodeCost(name="output", op=NodeOp.OUTPUT, target="output", inputs=(prev,)))
    from pipecut.planning.cluster.figures import family_model

    return estimate_rows(tuple(rows), work, device_profile(device), Precision.BF16,
                         compute_efficiency=compute_efficiency,
                         cost_model=family_model(device_profile(device), residual=compute_efficiency))


@dataclass(frozen=True, kw_only=True, slots=True)
class Predicted:
    tokens_per_s_per_gpu: float
    memory_gib: float
    mfu: float
    replicas: int
    stages: int
    layout: str
    exposed_comm_ms: float


def predict(run: PublishedRun, *, rows: tuple[NodeCost, ...] | None = None) -> Predicted:
    """pipecut's prediction of ``run`` (FSDP, one microbatch per step as torchtitan runs it).
    ``rows``: the cost table at the global batch; default :func:`estimated_rows`."""
    from pipecut.core.kinds import Recompute
    from pipecut.planning.cluster.choose import predict_run
    from pipecut.planning.cluster.figures import parse_cluster
    from pipecut.planning.cluster.plan import model_flops_per_token
    from pipecut.planning.cluster.run import RunShape

    cluster = parse_cluster(run.cluster)
    dims = LLAMA[run.model]
    batch = run.local_batch * cluster.gpus
    if rows is None:
        rows = estimated_rows(run, dims)
    flops = model_flops_per_token(rows, layers=dims.layers, hidden=dims.hidden, seq=run.seq)
    shape = RunShape(batch_size=batch, microbatches=1, tokens_per_sample=run.seq,
                     model_flops_per_token=flops, recompute=Recompute(run.recompute))
    best, _, _ = predict_run(rows, cluster, shape)
    return Predicted(
        tokens_per_s_per_gpu=best.tokens_per_s_per_gpu, memory_gib=best.peak_memory_bytes / 2**30,
        mfu=best.mfu, replicas=best.placement.replicas, stages=best.placement.stages,
        layout=best.placement.layout.value, exposed_comm_ms=best.exposed_comm_ms,
    )


GPIPE_MODEL = LlamaDims(layers=48, hidden=2048, ffn=8192, heads=16, kv_heads=16, vocab=32000)
"""A 48-layer Transformer for the GPipe row (its Transformer-L shape is not reproduced exactly:
the speedup is a ratio of bubble-bound steps, insensitive to the width)."""


def gpipe_speedup(*, microbatches: int = 32, seq: int = 1024) -> float:
    """Throughput of K = 8 over K = 2 pipeline stages (one replica, GPipe schedule, M = 32)."""
    from pipecut.core.kinds import Recompute, ScheduleKind
    from pipecut.planning.cluster.choose import predict_run
    from pipecut.planning.cluster.figures import family_efficiency, parse_cluster
    from pipecut.planning.cluster.plan import model_flops_per_token
    from pipecut.planning.cluster.run import RunShape

    out = []
    for k in (2, 8):
        cluster = parse_cluster(f"1x{k}xH100-SXM")
        efficiency, _ = family_efficiency(device_profile(cluster.device))
        rows = llama_rows(GPIPE_MODEL, samples=1, seq=seq, device=cluster.device,
                          compute_efficiency=efficiency)
        shape = RunShape(batch_size=microbatches, microbatches=microbatches, tokens_per_sample=seq,
                         model_flops_per_token=model_flops_per_token(rows), schedule=ScheduleKind.GPIPE,
                         recompute=Recompute.FULL)
        best, _, _ = predict_run(rows, cluster, shape, replicas=1)
        out.append(best.tokens_per_s_per_gpu * k)
    return out[1] / out[0]
