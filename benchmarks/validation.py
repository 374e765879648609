"""The validation table: pipecut's cluster prediction of each published run of
``validation_runs.json`` beside the published figure.

Each run's model is written as a cost table from its shapes (:func:`transformer_rows`: every
product, attention kernel, norm, dropout and loss with its FLOPs, bytes and saved bytes; no
capture, a few ms a run), priced by the per-op model of :mod:`pipecut.profile.hardware` at the
run's attention kernel, and run through :func:`pipecut.planning.cluster.choose.predict_run` with the
run's own data parallelism, pipeline depth, schedule, microbatches and checkpointing. The
prediction carries a range: the same run priced with every hardware figure at the fast and at
the slow end of its sources' spread. Each run names the framework that ran it
(``compiler/frameworks.json``, :mod:`pipecut.planning.cluster.frameworks`): its products are priced at
that framework's kernels' figure for the family (fitted on the split's run for those kernels), its
runtime's own memory is added (torchtitan's loss parallelism and pipeline buffers), and its
memory is compared as the framework's figure counts it. A run with ``async_tp`` hides each
tensor-parallel collective under its product (``shard_table(..., overlapped=True)``).

    from benchmarks import validation
    for row in validation.table(): print(row)
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipecut.core.kinds import AttentionKernel, Fp8Recipe, LeafKind, NodeOp
from pipecut.ir import Leaf, NodeCost
from pipecut.planning.cluster.frameworks import Overlap, fp8_saved, framework
from pipecut.profile.flops import NodeWork
from pipecut.profile.hardware import FigureEnd

__all__ = ["Choice", "Prediction", "load", "planner_choice", "predict", "table", "transformer_rows"]

DATA = Path(__file__).with_name("validation_runs.json")
UNBOUNDED_BYTES = 2**60
"""The GPU memory a run with a published outcome is priced at: none refused, each peak read."""
_TENSOR = '[1, {"type": null, "context": null, "children_spec": []}]'

def load() -> dict[str, Any]:
    return json.loads(DATA.read_text())  # type: ignore[no-any-return]


def transformer_rows(m: dict[str, Any], *, samples: int, seq: int, attention: str, dropout: bool,
                     loss_fp32: bool, head_params: bool, kv_seq: int | None = None,
                     ) -> tuple[tuple[NodeCost, ...], dict[str, NodeWork]]:
    """The cost table (times unset) and the work of a GPT (LayerNorm, GELU MLP, learned
    positions) or Llama (RMSNorm, SwiGLU, GQA) decoder at ``samples`` × ``seq`` tokens, bf16/fp16.
    ``attention``: "flash" (one SDPA node, causal: half the token pairs) or "eager" (score
    product, softmax, dropout, value product: what Megatron's default attention runs).
    ``head_params``: the output head holds its own weights (untied, or tied across stages).
    ``kv_seq``: the keys each query attends (context parallelism: the whole sequence, while a
    rank holds ``seq`` of its tokens; flash attention only)."""
    x, d, f, s, h, v = samples * seq, m["hidden"], m["ffn"], seq, m["heads"], m["vocab"]
    keys = kv_seq or seq
    assert keys == seq or attention == "flash", "context parallelism is priced on flash attention"
    kv = m.get("kv_heads", h) * d // h
    llama = m["arch"] == "llama"
    rows: list[NodeCost] = [NodeCost(name="input_ids", op=NodeOp.PLACEHOLDER, target="input_ids",
                                     output_bytes=8 * x, shape=(samples, seq), dtype="torch.int64")]
    work: dict[str, NodeWork] = {}
    prev = "input_ids"

    def add(name: str, module: str, target: str, *, shape: tuple[int, ...], saved: float, flops: float = 0,
            params: int = 0, moved: float = 0, bwd_flops: float | None = None, out: float | None = None) -> None:
        nonlocal prev
        inputs: tuple[str, ...] = (prev,)
        if params:
            rows.append(NodeCost(name=f"{name}_weight", op=NodeOp.GET_ATTR, target=f"{module}.weight",
                                 module=module, param_bytes=2 * params, parameters=(f"{module}.weight",)))
            inputs = (f"{name}_weight", prev)
        nbytes = int(out if out is not None else 2 * _prod(shape))
        rows.append(NodeCost(name=name, op=NodeOp.CALL_FUNCTION, target=target, module=module, inputs=inputs,
                             output_bytes=nbytes, saved_bytes=int(saved), shape=shape, dtype="bfloat16",
                             treespec=_TENSOR, leaves=(Leaf(kind=LeafKind.TENSOR, shape=shape, dtype="bfloat16",
                                                            requires_grad=True),)))
        fwd_bytes = int(moved or 2 * nbytes + 2 * params)
        work[name] = NodeWork(forward_flops=int(flops), backward_flops=int(2 * flops if bwd_flops is None else bwd_flops),
                              forward_bytes=fwd_bytes, backward_bytes=2 * fwd_bytes)
        prev = name

    act = (samples, seq, d)
    add("embedding", "model.embed_tokens", "embedding", shape=act, saved=0,
        params=v * d + (0 if llama else keys * d), moved=2 * 2 * x * d)
    for i in range(m["layers"]):
        b = f"model.layers.{i}"
        norm = "rms_norm" if llama else "layer_norm"
        add(f"l{i}_norm1", f"{b}.norm1", norm, shape=act, saved=2 * x * d, params=d)
        add(f"l{i}_qkv", f"{b}.attn.qkv", "linear", shape=(samples, seq, d + 2 * kv), saved=2 * x * d,
            flops=2 * x * d * (d + 2 * kv), params=d * (d + 2 * kv))
        if attention == "eager":
            dh = d // h
            scores = samples * h * s * s
            add(f"l{i}_scores", f"{b}.attn", "bmm", shape=(samples * h, s, s), saved=2 * x * (d + kv),
                flops=2 * scores * dh, moved=2 * x * (d + kv) + 2 * scores)
            add(f"l{i}_softmax", f"{b}.attn", "softmax", shape=(samples * h, s, s), saved=2 * scores,
                moved=4 * scores)
            if dropout:
                add(f"l{i}_attn_dropout", f"{b}.attn", "dropout", shape=(samples * h, s, s), saved=scores,
                    moved=5 * scores)
            add(f"l{i}_context", f"{b}.attn", "bmm", shape=(samples * h, s, dh), saved=2 * scores + 2 * x * kv,
                flops=2 * scores * dh, moved=2 * scores + 2 * x * kv + 2 * x * d)
        else:  # flash: q, k, v, out and the fp32 log-sum-exp saved; FLOPs as torch counts them
            # (every token pair; the model prices the causal half), backward 2.5x forward
            add(f"l{i}_sdpa", f"{b}.attn", "scaled_dot_product_attention", shape=act,
                saved=2 * x * (2 * d + 2 * kv) + 4 * x * h, flops=4 * x * keys * d, bwd_flops=10 * x * keys * d,
                moved=2 * x * (2 * d + 2 * kv))
        add(f"l{i}_o", f"{b}.attn.o", "linear", shape=act, saved=2 * x * d, flops=2 * x * d * d, params=d * d)
        if dropout:
            add(f"l{i}_dropout1", b, "dropout", shape=act, saved=x * d, moved=5 * x * d)
        add(f"l{i}_add1", b, "add", shape=act, saved=0, moved=6 * x * d)
        add(f"l{i}_norm2", f"{b}.norm2", norm, shape=act, saved=2 * x * d, params=d)
        up = 2 * f if llama else f
        add(f"l{i}_up", f"{b}.mlp.up", "linear", shape=(samples, seq, up), saved=2 * x * d,
            flops=2 * x * d * up, params=d * up)
        add(f"l{i}_act", f"{b}.mlp", "silu_mul" if llama else "gelu", shape=(samples, seq, f),
            saved=2 * x * up, moved=2 * x * (up + f))
        add(f"l{i}_down", f"{b}.mlp.down", "linear", shape=act, saved=2 * x * f, flops=2 * x * f * d, params=f * d)
        if dropout:
            add(f"l{i}_dropout2", b, "dropout", shape=act, saved=x * d, moved=5 * x * d)
        add(f"l{i}_add2", b, "add", shape=act, saved=0, moved=6 * x * d)
    add("norm", "model.norm", "rms_norm" if llama else "layer_norm", shape=act, saved=2 * x * d, params=d)
    add("lm_head", "lm_head", "linear", shape=(samples, seq, v), saved=2 * x * d, flops=2 * x * d * v,
        params=v * d if head_params else 0)
    width = 4 if loss_fp32 else 2  # the loss's softmax (and, in fp32, its copy of the logits)
    add("loss", "", "cross_entropy", shape=(1,), out=4, saved=(2 if loss_fp32 else 1) * width * x * v,
        moved=(2 + 2 * width) * x * v)
    rows.append(NodeCost(name="output", op=NodeOp.OUTPUT, target="output", inputs=(prev,)))
    return tuple(rows), work


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    name: str
    fitted: bool
    published_tokens: float | None
    """None: the run did not fit its GPUs (published out of memory), so no throughput."""
    tokens: float
    tokens_low: float
    tokens_high: float
    published_memory_gib: float | None
    memory_gib: float
    memory_low_gib: float
    memory_high_gib: float
    dominant: str
    stages: int
    replicas: int
    tensor_parallel: int = 1
    issue: int = 29
    """The issue whose check the row is: 29 (held to its tolerance) or 28 (tensor parallelism,
    reported with each miss explained)."""
    explained: str = ""
    """Why the prediction misses the published figure (the run's ``explained``), where it does."""
    published_fits: bool | None = None
    """The run's published outcome where its source prints one: it fit its GPUs (it trained),
    or it ran out of memory; None: not published as an outcome (the row trained, and is priced
    as fitting, a row over its GPU's memory raising)."""
    fits: bool | None = None
    """The predicted outcome of a row with a published one: its peak with every overhead a
    process holds (the CUDA context, NCCL's buffers, the allocator's reserve) within the
    GPU's memory; the row is priced with the memory unbounded, so a wrong outcome shows."""
    needs_gib: float | None = None
    """That peak, where the outcome is predicted."""

    @property
    def error(self) -> float:
        assert self.published_tokens is not None, f"{self.name} ran out of memory: it has no throughput"
        return self.tokens / self.published_tokens - 1

    @property
    def outcome_right(self) -> bool | None:
        return None if self.published_fits is None else self.published_fits == self.fits

    @property
    def memory_error(self) -> float | None:
        return None if self.published_memory_gib is None else self.memory_gib / self.published_memory_gib - 1


def _published_tokens(run: dict[str, Any], model: dict[str, Any]) -> float | None:
    """Tokens/s per GPU as published, or from seconds per iteration of a global batch, or from
    samples/s, or from Megatron's teraFLOP/s per GPU
    with its own count: ``F = 96 B s l h² (1 + s/6h + V/16lh)`` per iteration of B sequences
    (Narayanan et al. 2021, the recomputed forward included), so a token costs F / (B s); or
    from Megatron-Core's model teraFLOP/s, ``72 B s l h² (1 + s/6h + V/12lh)`` (nothing
    recomputed counted)."""
    p = run["published"]
    if p.get("outcome") == "oom":
        return None
    if "seconds_per_iteration" in p:
        from pipecut.planning.cluster.figures import parse_cluster

        gpus = parse_cluster(run["cluster"]).gpus
        return float(p["global_batch"]) * run["seq"] / (float(p["seconds_per_iteration"]) * gpus)
    if "tokens_per_s_per_gpu" in p:
        return float(p["tokens_per_s_per_gpu"])
    if "model_tflops_per_gpu" in p:  # Megatron-Core's count, without the recomputed forward
        s, layers, h, v = run["seq"], model["layers"], model["hidden"], model["vocab"]
        per_token = 72 * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
        return float(p["model_tflops_per_gpu"]) * 1e12 / per_token
    if "tflops_per_gpu" in p:
        s, layers, h, v = run["seq"], model["layers"], model["hidden"], model["vocab"]
        per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        return float(p["tflops_per_gpu"]) * 1e12 / per_token
    return float(p["samples_per_s_per_gpu"]) * run["seq"]


def _one(run: dict[str, Any], model: dict[str, Any], *, bound: FigureEnd, residual: float | None,
         planner: bool = False) -> tuple[Any, float]:
    """The run priced at ``bound``: its best candidate and its memory as the source counts it.
    ``planner``: instead of the run's own D × T × K, the planner's choice for the same cluster,
    batch, microbatches, schedule and checkpointing (every D and every T the heads allow). A run
    with a published outcome (fit or out of memory) is priced with its GPUs' memory unbounded:
    whether it fits is then read from its peak (:func:`predict`)."""
    from pipecut.core.kinds import DataParallelKind, Recompute, ScheduleKind
    from pipecut.passes.parallel.tensor import tensor_sizes
    from pipecut.planning.cluster.choose import predict_run
    from pipecut.planning.cluster.figures import cluster_at, family_model, parse_cluster
    from pipecut.planning.cluster.plan import model_flops_per_token
    from pipecut.planning.cluster.run import RunShape
    from pipecut.planning.cluster.tables import sharded_tables
    from pipecut.profile.devices import device_profile
    from pipecut.profile.hardware import memory_overheads

    cluster = parse_cluster(run["cluster"], inter_bytes_per_s=run.get("inter_bytes_per_s"))
    profile = device_profile(cluster.device)
    if bound is not FigureEnd.VALUE:  # links at the same end of their range as the kernels
        cluster = cluster_at(cluster, profile, bound)
    if "outcome" in run["published"]:
        cluster = dataclasses.replace(cluster, memory_bytes=UNBOUNDED_BYTES)
    tp, sp, cp = run.get("tp", 1), run.get("sequence_parallel", False), run.get("cp", 1)
    replicas = cluster.gpus // (run["pp"] * tp)  # with context parallelism D x CP ranks, each 1/CP of a sample
    samples = run["microbatch_size"] * replicas  # the cost table is at one microbatch of the global batch
    rows, work = transformer_rows(model, samples=samples, seq=run["seq"] // cp, kv_seq=run["seq"], attention=run["attention"],
                                  dropout=run.get("dropout", run["framework"] == "megatron"), loss_fp32=run["loss_fp32"],
                                  head_params=not model["tied"] or run["pp"] > 1)
    ran = framework(run["framework"])  # its kernels' figure (fitted on the split's run), its runtime, its memory counts
    ran.check_overlaps(tuple(o for o, asked in ((Overlap.TENSOR_PARALLEL, run.get("async_tp", False)),
                                                (Overlap.DATA_PARALLEL, run.get("overlapped_reduction", False))) if asked),
                       run["name"])
    fp8 = run["precision"] == "fp8"  # the blocks' linears in FP8 (Transformer Engine's), the output layer in bf16
    fp8_rows = frozenset(r.name for r in rows if r.target == "linear" and r.name != "lm_head") if fp8 else frozenset()
    rows = fp8_saved(rows, fp8_rows)  # their inputs kept for the backward in FP8
    hw = family_model(profile, attention=AttentionKernel.FLASH if run["attention"] == "flash" else AttentionKernel.EFFICIENT, bound=bound,
                      residual=residual, framework_kind=ran.kind, fp8_rows=fp8_rows,
                      fp8_recipe=Fp8Recipe(run.get("fp8_recipe", "delayed")))
    assert hw is not None, f"no hardware figures for {profile.name}"
    nodes = hw.price(rows, work)
    flops = model_flops_per_token(nodes, layers=model["layers"], hidden=model["hidden"], seq=run["seq"])
    ring = _context_ring(run, model, cluster, rows, work, replicas) if cp > 1 else None
    if ring is not None:
        nodes = ring(nodes, 1)
    # The planner's layout must fit the GPU as a run fills it (CUDA context, NCCL's buffers, the
    # allocator's reserve), as plan_cluster checks it; the published layout ran, so it is priced alone.
    over = memory_overheads(1.0, bound=bound)
    fixed = math.ceil(over["context"] + over["nccl"]) if planner else 0
    shape = RunShape(batch_size=samples * run["microbatches"], microbatches=run["microbatches"],
                     tokens_per_sample=run["seq"] // cp, model_flops_per_token=flops,
                     schedule=ScheduleKind(run["schedule"]), stages_per_rank=run["stages_per_rank"],
                     recompute=Recompute(run["recompute"]),
                     sharding=DataParallelKind.DDP if run["dp"] == "none" else DataParallelKind(run["dp"]),
                     sequence_parallel=sp, fixed_memory_bytes=fixed, runtime_terms=ran.runtime_terms,
                     overlapped_reduction=run.get("overlapped_reduction", False),
                     distributed_optimizer=ran.distributed_optimizer,
                     bf16_gradients=not run.get("grad_reduce_in_fp32", True),
                     reserve_fraction=over["fragmentation"] if planner else 0.0)
    sizes = tensor_sizes(cluster.gpus_per_node, (model["heads"], model.get("kv_heads", model["heads"]))) \
        if planner else (tp,)
    sharded = sharded_tables(nodes, sizes, cluster, sequence_parallel=sp, model=hw, counted=(rows, work),
                             overlapped=run.get("async_tp", False), regather=ran.regathers)
    if ring is not None:  # the per-GPU tables priced again from the rows: their rings again, at 1/T of the chunk
        sharded = {t: dataclasses.replace(table, nodes=ring(table.nodes, t)) for t, table in sharded.items()}
    best, _, _ = predict_run(nodes, cluster, shape, replicas=None if planner else replicas, schedules=(shape.schedule,),
                             tensor_parallel=sizes, sharded=sharded, search_wider=False)
    counted = ran.memory_counts
    if planner:  # its peak holds every overhead: keep those the source counts
        parts = dict(best.memory_parts)
        kept = ("state", "activations", *(("allocator reserve",) if "fragmentation" in counted else ()))
        return best, sum(parts.get(k, 0) for k in kept) / 2**30
    extra = sum(b for k, b in memory_overheads(best.peak_memory_bytes, bound=bound).items() if k in counted)
    return best, (best.peak_memory_bytes + extra) / 2**30


def _context_ring(run: dict[str, Any], model: dict[str, Any], cluster: Any, rows: Any, work: Any,
                  replicas: int) -> Any:
    """The ring of a context-parallel run: ``(nodes, T) -> nodes`` with each attention's exposed
    ring added (:func:`pipecut.planning.cluster.context.with_context_parallel`). One rank's key
    and value chunk: its ``seq / CP`` tokens of its microbatch, the KV heads' width over T, bf16.
    The CP group's link: NVLink where T x CP GPUs fit in a node (Megatron orders TP, then CP),
    else the network."""
    from pipecut.planning.cluster.context import with_context_parallel

    cp, tp = run["cp"], run.get("tp", 1)
    kv = model.get("kv_heads", model["heads"]) * model["hidden"] // model["heads"]
    link = cluster.intra if tp * cp <= cluster.gpus_per_node else cluster.inter
    tokens = run["microbatch_size"] * run["seq"] // cp
    names = [r.name for r in rows if r.target == "scaled_dot_product_attention"]

    def ring(nodes: Any, t: int) -> Any:
        chunk = 2 * 2 * tokens * kv / t  # K and V, bf16
        return with_context_parallel(nodes, work, cp, link, dict.fromkeys(names, chunk), replicas=replicas)
    return ring


def _dominant(best: Any) -> str:
    """Which assumption dominates the step: the largest of its parts on the GPU that ends it
    (:func:`pipecut.planning.cluster.run.step_parts`): compute, recompute, the bubble or a link."""
    return best.parts[0][0] if best.parts else "compute"


def predict(run: dict[str, Any], models: dict[str, Any], *, residual: float | None = None) -> Prediction:
    from pipecut.planning.cluster.figures import parse_cluster
    from pipecut.profile.hardware import memory_overheads

    model = models[run["model"]]
    best, mem = _one(run, model, bound=FigureEnd.VALUE, residual=residual)
    fast, mem_lo = _one(run, model, bound=FigureEnd.FAST, residual=residual)
    slow, mem_hi = _one(run, model, bound=FigureEnd.SLOW, residual=residual)
    pub_mem = run["published"].get("memory_gib")
    outcome = run["published"].get("outcome")
    needs = fits = None
    if outcome is not None:  # the GPU's capacity is read only where an outcome is predicted against it
        needs = (best.peak_memory_bytes + sum(memory_overheads(best.peak_memory_bytes).values())) / 2**30
        fits = needs <= parse_cluster(run["cluster"]).memory_bytes / 2**30
    return Prediction(
        name=run["name"], fitted=run["fitted"], published_tokens=_published_tokens(run, model),
        tokens=best.tokens_per_s_per_gpu, tokens_low=min(t.tokens_per_s_per_gpu for t in (best, fast, slow)),
        tokens_high=max(t.tokens_per_s_per_gpu for t in (best, fast, slow)),
        published_memory_gib=None if pub_mem is None else float(pub_mem), memory_gib=mem,
        memory_low_gib=min(mem, mem_lo, mem_hi), memory_high_gib=max(mem, mem_lo, mem_hi), dominant=_dominant(best), stages=best.placement.stages, replicas=best.placement.replicas,
        tensor_parallel=best.placement.tensor_parallel, issue=run.get("issue", 29), explained=run.get("explained", ""),
        published_fits=None if outcome is None else outcome == "fits",
        fits=fits, needs_gib=needs,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """The planner's own layout for a published run's cluster, batch and schedule."""

    name: str
    replicas: int
    tensor_parallel: int
    stages: int
    tokens: float
    """Predicted tokens/s per GPU of the planner's layout (the published layout's is the row's)."""
    memory_gib: float
    """Its predicted peak memory per GPU, as the row's source counts it."""


def planner_choice(run: dict[str, Any], models: dict[str, Any]) -> Choice:
    """What :func:`pipecut.planning.cluster.choose.predict_run` chooses for ``run`` when D and T are
    left to it (the schedule, microbatches and checkpointing kept)."""
    best, mem = _one(run, models[run["model"]], bound=FigureEnd.VALUE, residual=None, planner=True)
    return Choice(name=run["name"], replicas=best.placement.replicas, tensor_parallel=best.placement.tensor_parallel,
                  stages=best.placement.stages, tokens=best.tokens_per_s_per_gpu, memory_gib=mem)


def table() -> list[Prediction]:
    """Every run priced at its published layout. Each of them trained, so each must fit: a row the
    model finds over its GPU's memory raises (a wrong fit / out-of-memory outcome)."""
    data = load()
    return [predict(r, data["models"]) for r in data["runs"]]


def fit(run_name: str, lo: float = 0.3, hi: float = 0.95, steps: int = 14) -> float:
    """The residual at which ``run_name``'s predicted throughput equals the published one."""
    data = load()
    run = next(r for r in data["runs"] if r["name"] == run_name)
    target = _published_tokens(run, data["models"][run["model"]])
    for _ in range(steps):
        mid = (lo + hi) / 2
        best, _ = _one(run, data["models"][run["model"]], bound=FigureEnd.VALUE, residual=mid)
        lo, hi = (mid, hi) if best.tokens_per_s_per_gpu < target else (lo, mid)
    return round((lo + hi) / 2, 3)


def summary(preds: list[Prediction], issue: int = 29) -> dict[str, float]:
    """Issue 29's figures over an issue's unfitted rows (each issue's rows are reported apart),
    and where rows publish them: the median memory error, the outcomes predicted right."""
    unfitted = [p for p in preds if not p.fitted and p.issue == issue]
    errs = [abs(p.error) for p in unfitted if p.published_tokens is not None]
    mems = [abs(p.memory_error) for p in unfitted if p.memory_error is not None]
    outcomes = [p.outcome_right for p in unfitted if p.outcome_right is not None]
    return {"median_abs_error": statistics.median(errs), "worst_abs_error": max(errs),
            "worst_abs_memory_error": max(mems) if mems else 0.0,
            "median_abs_memory_error": statistics.median(mems) if mems else 0.0,
            "memory_rows": len(mems), "outcomes": len(outcomes), "outcomes_right": sum(outcomes)}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties ranked by their mean rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    return statistics.correlation(ranks(xs), ranks(ys))


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    """Unfitted rows of one source on one model and cluster that trained: one sweep of layouts
    or schedules, and how its predictions rank them."""
    source: str
    model: str
    cluster: str
    issue: int
    rows: int
    spearman: float
    """Between the predicted and the published throughput (1: ranked as measured)."""


def sweeps(preds: list[Prediction], least: int = 3) -> list[Sweep]:
    """Every sweep of at least ``least`` rows, in the table's order."""
    runs = {r["name"]: r for r in load()["runs"]}
    groups: dict[tuple[str, str, str], list[Prediction]] = {}
    for p in preds:
        r = runs[p.name]
        if not p.fitted and p.published_tokens is not None:
            groups.setdefault((r["source"], r["model"], r["cluster"]), []).append(p)
    return [Sweep(source=source, model=model, cluster=cluster, issue=rows[0].issue, rows=len(rows),
                  spearman=spearman([p.tokens for p in rows], [p.published_tokens for p in rows
                                                               if p.published_tokens is not None]))
            for (source, model, cluster), rows in groups.items() if len(rows) >= least]
