"""Tensor-parallel stages (issue 28): a ("pp", "tp") or ("dp", "pp", "tp") DeviceMesh, each
stage's layers split over its tensor group as DTensors, against the plain model in one process.

Per model, one step of the pipeline and one of the plain model (the mean of the microbatch
losses, the same split into microbatches): the loss on every rank, every gradient gathered to
its full tensor (each parameter must come from some rank), and every parameter after one AdamW
step. Scenarios share forks: forking is cheap, compiling is not.

Tolerances: float32. A split product sums its partial results across the group (all-reduce)
instead of in one kernel, and the pipeline runs the captured ATen graph while the reference runs
the eager modules, so the same math is grouped differently: measured, losses equal to the bit
and gradients within 8.2e-7 of each tensor's largest entry (TP 2 x PP 2, five models).
``atol=1e-5, rtol=1e-4`` (as tests/multiprocess/test_zoo.py) leaves an order of margin and is far below
any real error (a missing partial sum or a wrong shard is off by > 1e-2). AdamW's first step
moves each weight by lr·g/(|g| + eps), which amplifies the rounding of gradients near zero:
weights after the step differ by at most 5.4e-5 (GPT-2; 1.5e-6 for Llama) with lr = 1e-3, so
``PARAM_ATOL = 2e-4``, while a wrong gradient's sign moves a weight by ~2·lr = 2e-3.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import pipecut
from examples import gpt, pinned, zoo
from pipecut.core.batching import split_microbatches
from pipecut.core.graph import canonical_names
from pipecut.runtime.state import checkpoint
from tests.harness import run_ranks
from tests.reference import COUNTED

pytestmark = pytest.mark.dist

ATOL, RTOL = 1e-5, 1e-4
LR = 1e-3
PARAM_ATOL = 2e-4
NO_CLIP = 1e6  # clip_grad_norm_ at a bound no norm here reaches: the norm over every rank's gradients, unclipped
MICROBATCHES = 2
BATCH = 4


def _one_step(model: nn.Module, inputs: Any, loss_fn: Any, target: Any, mesh: Any, **kwargs: Any) -> dict[str, Any]:
    """Compile over ``mesh``, one step, gradients gathered, one AdamW step, parameters gathered
    (collectives over each tensor group: every rank walks its parameters in the same order)."""
    names = canonical_names(model)
    alias = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    pipe = pipecut.compile(model, inputs, mesh, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                           schedule=kwargs.pop("schedule", "1f1b"), measure=COUNTED,
                           runtime=pipecut.RuntimeOptions(timeout=60), **kwargs)
    loss = pipe.step(inputs, target)
    named = list(pipe.named_parameters())
    grads = {alias[n]: zoo.whole_copy(p.grad) for n, p in named if p.grad is not None}
    split = sorted(alias[n] for n, p in named if isinstance(p, DTensor))
    norm = pipe.clip_grad_norm_(NO_CLIP)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    opt.step()
    params = {alias[n]: zoo.whole_copy(p) for n, p in named}
    return {"loss": loss.detach().clone(), "grads": grads, "params": params, "split": split, "norm": norm,
            "recompute": [s.recompute.value for s in pipe.plan.stages],
            "planned_bytes": sum(n.param_bytes for n in pipe.plan.nodes),
            "token_shards": sum(getattr(n.target, "__name__", "") == "token_shard"
                                for m in pipe.modules for n in m.graph.nodes),
            "local_heads": sum(getattr(n.target, "__name__", "") == "local_heads_attention"
                               for m in pipe.modules for n in m.graph.nodes),
            "wire": [(leaf.shape, w.wire_shape(w.in_spec, leaf)) for w in pipe.workers.values()
                     for leaf in w.in_spec.tensors]}


def _reference(model: nn.Module, inputs: Any, loss_fn: Any, target: Any, microbatches: int = MICROBATCHES) -> dict[str, Any]:
    names = canonical_names(model)
    total = torch.zeros(())
    batch = len(target)
    for mb, t in zip(split_microbatches(inputs, microbatches, batch),
                     split_microbatches(target, microbatches, batch, "target")):
        out = model(**mb) if isinstance(mb, dict) else model(*mb)
        loss = loss_fn(out, t) / microbatches
        loss.backward()
        total += loss.detach()
    grads = {names[id(p)]: p.grad.clone() for p in model.parameters() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), NO_CLIP)
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    return {"loss": total, "grads": grads, "norm": norm,
            "params": {names[id(p)]: p.detach().clone() for p in model.parameters()}}


def _check(want: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for r, got in enumerate(ranks):
        if want["loss"] is not None:
            torch.testing.assert_close(got["loss"], want["loss"], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, r=r: f"rank {r} loss: {m}")
        torch.testing.assert_close(got["norm"], want["norm"], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, r=r: f"rank {r} gradient norm: {m}")
        for name, g in got["grads"].items():
            torch.testing.assert_close(g, want["grads"][name], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, r=r, name=name: f"rank {r} grad {name}: {m}")
            seen.add(name)
        for name, p in got["params"].items():
            torch.testing.assert_close(p, want["params"][name], atol=PARAM_ATOL, rtol=RTOL,
                                       msg=lambda m, r=r, name=name: f"rank {r} param {name}: {m}")
    assert seen == set(want["grads"]), f"gradients on no rank: {sorted(set(want['grads']) - seen)}"


# --- models ----------------------------------------------------------------------------------------
class Mlp(nn.Module):
    """A user model without a tp_plan: two pairs the graph finds (up → down), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(zoo.VOCAB, zoo.HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(zoo.HIDDEN, 2 * zoo.HIDDEN), nn.GELU(),
                                                  nn.Linear(2 * zoo.HIDDEN, zoo.HIDDEN)) for _ in range(2))
        self.norm = nn.LayerNorm(zoo.HIDDEN)
        self.head = nn.Linear(zoo.HIDDEN, zoo.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def mlp(batch_size: int = BATCH, seed: int = 0) -> zoo.Built:
    torch.manual_seed(seed)
    tokens = torch.randint(0, zoo.VOCAB, (batch_size, zoo.SEQ + 1))
    return Mlp(), (tokens[:, :-1],), lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()), tokens[:, 1:]


def mixtral(batch_size: int = BATCH, seed: int = 0) -> zoo.Built:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=zoo.VOCAB, hidden_size=zoo.HIDDEN, intermediate_size=zoo.HIDDEN, num_hidden_layers=2,
        num_attention_heads=zoo.HEADS, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=zoo.SEQ, attention_dropout=0.0, router_aux_loss_coef=0.0,
    )
    model = MixtralForCausalLM(config)
    ids, target = zoo._tokens(batch_size)
    return model, {"input_ids": ids}, zoo.logits_ce, target


def gpt_example(batch_size: int = BATCH, seed: int = 0) -> zoo.Built:
    """examples/gpt.py, small: symbolic_trace's module calls with a tied embedding and head."""
    return gpt.build(batch_size, seed, vocab=zoo.VOCAB, dim=zoo.HIDDEN, heads=zoo.HEADS, layers=2, seq=zoo.SEQ)


def gpt_odd(batch_size: int = BATCH, seed: int = 0) -> zoo.Built:
    """The same with a token count the group size does not divide (cut values travel whole)."""
    return gpt.build(batch_size, seed, vocab=zoo.VOCAB, dim=zoo.HIDDEN, heads=zoo.HEADS, layers=2, seq=zoo.SEQ - 1)


def llama_eager(batch_size: int = BATCH, seed: int = 0) -> zoo.Built:
    """The Llama with eager attention (the zoo's is transformers' default, SDPA): attention as
    products and a softmax on DTensors, the path every model took before local heads."""
    return zoo.llama(batch_size, seed, attention="eager")


MODELS = {"llama": zoo.llama, "qwen2": zoo.qwen2, "gpt2": zoo.gpt2, "mixtral": mixtral, "bert": zoo.bert,
          "mlp": mlp, "gpt": gpt_example, "gpt-odd": gpt_odd, "llama-eager": llama_eager}
SEQUENCE_PARALLEL = ("llama", "gpt2", "gpt-odd")  # a norm's weight read directly, through a tied vocab split, in a module
"""Run with TensorParallelOptions(sequence_parallel=True): norms and residual adds on token shards."""
PLAIN = ("llama", "qwen2", "gpt2", "mixtral", "bert", "mlp", "gpt", "llama-eager")
"""Run without. The transformers models (but llama-eager) with transformers' default attention,
SDPA, which runs on each rank's own heads; BERT with a padding mask."""
SDPA = ("llama", "qwen2", "gpt2", "mixtral", "bert")
"""Models whose attention is ``scaled_dot_product_attention``."""


def _pp_tp(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    out = {}
    for name in PLAIN:
        out[name] = _one_step(*MODELS[name](batch_size=BATCH), mesh)
    tokens = pipecut.TensorParallelOptions(sequence_parallel=True)
    for name in SEQUENCE_PARALLEL:
        out[f"{name}+sp"] = _one_step(*MODELS[name](batch_size=BATCH), mesh, tensor_parallel=tokens)
    for name, schedule, sp in SPLIT_BACKWARD:
        out[f"{name} {schedule}{'+sp' if sp else ''}"] = _one_step(
            *MODELS[name](batch_size=BATCH), mesh, schedule=schedule,
            tensor_parallel=pipecut.TensorParallelOptions(sequence_parallel=sp),
            scheduling=pipecut.ScheduleOptions(stages_per_rank=2 if schedule == "zbv" else 1))
    for name, schedule in CLUSTER_PLANS:
        plan = _broadcast_plan(lambda name=name, schedule=schedule: _cluster_plan(name, schedule))
        out[f"cluster {name} {schedule}"] = {
            **_one_step(*MODELS[name](batch_size=BATCH), mesh, schedule=schedule, plan=plan),
            "planned": [s.recompute.value for s in plan.stages]}
    return out


CLUSTER_PLANS = [("llama", "zero-bubble"), ("gpt2", "zbv")]
"""Cluster plans of a node of four H100s at T = 2, D = 1, K = 2 (the cluster plan's defaults:
sequence parallelism, selective recompute), replayed over this ("pp", "tp") mesh: the stages
as planned, the weight pass over DTensor parameters, the residual stream's token shards."""


def _cluster_plan(name: str, schedule: str, replicas: int = 1) -> pipecut.Plan:
    """The cluster plan of ``name`` at T = 2, K = 2 and D = ``replicas`` on one node of 4 × D
    H100s, for a batch of ``BATCH`` samples per replica (one replica's share is what it plans)."""
    from pipecut.planning.cluster.plan import plan_cluster

    model, inputs, loss_fn, target = MODELS[name](batch_size=BATCH * replicas)
    return plan_cluster(model, inputs, f"1x{4 * replicas}xH100-SXM", microbatches=MICROBATCHES, schedule=schedule,
                        tensor_parallel=2, data_parallel=pipecut.DataParallelOptions(replicas=replicas),
                        loss_fn=loss_fn, target=target)


def _broadcast_plan(make: Any) -> pipecut.Plan:
    """Rank 0's plan on every rank (planning here is deterministic, but one plan is what compile replays)."""
    box = [make().to_json() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return pipecut.Plan.from_json(box[0])


SPLIT_BACKWARD = [("llama", "zero-bubble", False), ("llama", "zbv", True), ("gpt2", "zbv", False),
                  ("gpt2", "zero-bubble", True)]
"""Zero-bubble and ZBV over tensor-parallel stages, with and without sequence parallelism: the
weight pass runs autograd over DTensor parameters (GPT-2: its head tied to the split vocabulary
embedding, on one rank under ZBV's V)."""


@pytest.fixture(scope="module")
def pp2_tp2() -> list[dict[str, Any]]:
    return run_ranks(_pp_tp, 4, timeout=800, collective_timeout=120)


@pytest.mark.timeout(860)
@pytest.mark.parametrize("name", PLAIN)
def test_tp2_pp2_matches_the_plain_model(pp2_tp2: list[dict[str, Any]], name: str) -> None:
    _check(_reference(*MODELS[name](batch_size=BATCH)), [r[name] for r in pp2_tp2])
    assert pp2_tp2[0][name]["split"], "no parameter was split"
    assert all(r[name]["token_shards"] == 0 for r in pp2_tp2)
    # attention ran on each rank's own heads wherever the model has it (not through DTensor's propagation)
    assert (sum(r[name]["local_heads"] for r in pp2_tp2) > 0) == (name in SDPA), [r[name]["local_heads"] for r in pp2_tp2]
    assert all(spec == wire for r in pp2_tp2 for spec, wire in r[name]["wire"]), "cut values travel whole"
    # the plan priced one rank's share: the weights the graph splits count half
    model, inputs, loss_fn, target = MODELS[name](batch_size=BATCH)
    whole = pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                         schedule="1f1b", measure=COUNTED)
    assert pp2_tp2[0][name]["planned_bytes"] < sum(n.param_bytes for n in whole.nodes)


@pytest.mark.timeout(860)
@pytest.mark.parametrize("case", SPLIT_BACKWARD, ids=lambda c: f"{c[0]}-{c[1]}{'-sp' if c[2] else ''}")
def test_zero_bubble_and_zbv_over_tensor_parallel_stages_match_the_plain_model(
        pp2_tp2: list[dict[str, Any]], case: tuple[str, str, bool]) -> None:
    name, schedule, sp = case
    got = [r[f"{name} {schedule}{'+sp' if sp else ''}"] for r in pp2_tp2]
    _check(_reference(*MODELS[name](batch_size=BATCH)), got)
    assert all(r["split"] for r in got), "no parameter was split"
    assert all((r["token_shards"] >= 2) == sp for r in got), [r["token_shards"] for r in got]


@pytest.mark.timeout(860)
@pytest.mark.parametrize("case", CLUSTER_PLANS, ids=lambda c: f"{c[0]}-{c[1]}")
def test_a_cluster_plan_with_tensor_parallelism_replays_over_a_tp_mesh_at_parity(
        pp2_tp2: list[dict[str, Any]], case: tuple[str, str]) -> None:
    """plan(cluster=...) at T = 2 is compile's to run (it was refused as "not replayed"): its
    stages, schedule and recompute as planned, sequence parallelism from its run, at parity."""
    name, schedule = case
    plan = _cluster_plan(name, schedule)
    assert plan.placement is not None and plan.placement.tensor_parallel == 2 and plan.run is not None
    assert plan.run.sequence_parallel and plan.schedule.value == schedule
    got = [r[f"cluster {name} {schedule}"] for r in pp2_tp2]
    _check(_reference(*MODELS[name](batch_size=BATCH)), got)
    assert all(r["split"] for r in got), "no parameter was split"
    assert all(r["token_shards"] >= 2 for r in got), [r["token_shards"] for r in got]
    assert all(r["recompute"] == r["planned"] for r in got)
    assert "selective" in got[0]["planned"], got[0]["planned"]


@pytest.mark.timeout(860)
@pytest.mark.parametrize("name", SEQUENCE_PARALLEL)
def test_tp2_pp2_with_sequence_parallelism_matches_the_plain_model(pp2_tp2: list[dict[str, Any]], name: str) -> None:
    """Each closing product reduce-scatters into token shards (one per row product and vocabulary
    embedding, on both stages), the norms and residual adds run on them, and the numbers are
    the plain model's as without. The residual stream crosses the cut as each rank's tokens
    (half of them here), or whole where the group size does not divide the tokens (gpt-odd)."""
    _check(_reference(*MODELS[name](batch_size=BATCH)), [r[f"{name}+sp"] for r in pp2_tp2])
    assert all(r[f"{name}+sp"]["token_shards"] >= 2 for r in pp2_tp2)
    mb = BATCH // MICROBATCHES
    tokens = zoo.SEQ - 1 if name == "gpt-odd" else zoo.SEQ
    stream = [wire for r in pp2_tp2 for spec, wire in r[f"{name}+sp"]["wire"] if spec == (mb, tokens, zoo.HIDDEN)]
    assert stream, "no residual stream crosses the cut"
    travels = (mb, tokens, zoo.HIDDEN) if name == "gpt-odd" else (mb, tokens // 2, zoo.HIDDEN)
    assert all(wire == travels for wire in stream), stream


# --- D x T x K: FSDP2 over "dp" ------------------------------------------------------------------
def _dp_pp_tp(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    replica = mesh.get_local_rank("dp")
    model, inputs, loss_fn, target = zoo.llama(batch_size=2 * BATCH)
    half = slice(BATCH * replica, BATCH * (replica + 1))  # each replica trains on its half
    local = ({"input_ids": inputs["input_ids"][half]}, target[half])
    out: dict[str, Any] = {"replica": replica}
    for kind, schedule in DP_TP:  # DDP over DTensors: FSDP2's replicate-only twin, here with sequence parallelism
        model, _, loss_fn, _ = zoo.llama(batch_size=2 * BATCH)
        tokens = pipecut.TensorParallelOptions(sequence_parallel=kind == "ddp")
        out[(kind, schedule)] = _one_step(model, local[0], loss_fn, local[1], mesh, data_parallel=kind,
                                          tensor_parallel=tokens, schedule=schedule)
    plan = _broadcast_plan(lambda: _cluster_plan("llama", "zero-bubble", replicas=2))
    model, _, loss_fn, _ = zoo.llama(batch_size=2 * BATCH)
    out[CLUSTER_DTK] = {**_one_step(model, local[0], loss_fn, local[1], mesh, schedule="zero-bubble", plan=plan),
                        "data_parallel": plan.data_parallel}
    return out


DP_TP = [("fsdp", "1f1b"), ("ddp", "1f1b"), ("fsdp", "zero-bubble"), ("ddp", "zero-bubble")]
CLUSTER_DTK = ("cluster plan", "zero-bubble")
"""The cluster plan of the zoo's Llama on a node of 8 H100s at D 2 × T 2 × K 2 (FSDP2, sequence
parallelism and selective recompute, the planner's choices), replayed over this mesh."""


@pytest.mark.timeout(600)
def test_dp2_tp2_pp2_with_fsdp_and_ddp_matches_the_whole_batch() -> None:
    """8 ranks: 2 replicas (FSDP2, then DDP with sequence parallelism, over "dp") x 2 stages x
    2-way tensor groups, under 1F1B and zero-bubble (whose weight pass writes the DTensor
    gradients that the replicas then reduce), and a cluster plan of that D x T x K replayed. Gradients are averaged over the replicas, so they equal the plain
    model's over the whole batch in 4 microbatches; each replica's loss is its half's."""
    ranks = run_ranks(_dp_pp_tp, 8, timeout=560, collective_timeout=120)
    model, inputs, loss_fn, target = zoo.llama(batch_size=2 * BATCH)
    want = _reference(model, inputs, loss_fn, target, microbatches=2 * MICROBATCHES)
    for case in (*DP_TP, CLUSTER_DTK):
        losses = {r["replica"]: r[case]["loss"] for r in ranks}
        torch.testing.assert_close((losses[0] + losses[1]) / 2, want["loss"], atol=ATOL, rtol=RTOL, msg=str(case))
        _check({**want, "loss": None}, [r[case] for r in ranks])
        assert all((r[case]["token_shards"] >= 2) == (case[0] != "fsdp") for r in ranks), case
    assert ranks[0][CLUSTER_DTK]["data_parallel"] == pipecut.DataParallelOptions(kind="fsdp", replicas=2)
    assert "selective" in ranks[0][CLUSTER_DTK]["recompute"], ranks[0][CLUSTER_DTK]["recompute"]


# --- compositions: no_sync, clipping, save_pretrained, DCP checkpoints, full and selective recompute and
# interleaving (all with sequence parallelism), autocast
CLIP = 0.5
# bf16 keeps 8 bits of mantissa (2e-3 relative per op). Under autocast a split product rounds
# each rank's partial sum to bf16 before the all-reduce, where the plain model rounds the whole
# sum once: measured at most ~4e-3 of each tensor's largest entry; 2e-2 leaves a 5x margin,
# and a lost microbatch or shard is off by O(1).
AMP_REL = 2e-2


def _compositions(rank: int, world: int, directory: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    model, inputs, loss_fn, target = zoo.gpt2(batch_size=2 * BATCH)
    ids = inputs["input_ids"]
    first, second = ({"input_ids": ids[:BATCH]}, target[:BATCH]), ({"input_ids": ids[BATCH:]}, target[BATCH:])
    names = canonical_names(model)
    alias = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    pipe = pipecut.compile(model, first[0], mesh, loss_fn=loss_fn, target=first[1], microbatches=MICROBATCHES,
                           schedule="1f1b", measure=COUNTED, runtime=pipecut.RuntimeOptions(timeout=60))
    with pipe.no_sync():  # accumulation: the tied head's sum waits for the last step
        pipe.step(*first)
    pipe.step(*second)
    accumulated = {alias[n]: zoo.whole_copy(p.grad) for n, p in pipe.named_parameters()}
    norm = pipe.clip_grad_norm_(CLIP)
    clipped = {alias[n]: zoo.whole_copy(p.grad) for n, p in pipe.named_parameters()}
    pipe.save_pretrained(directory)
    out: dict[str, Any] = {"accumulated": accumulated, "norm": norm, "clipped": clipped}
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    opt.step()  # a checkpoint of split stages: each rank writes its shards (DCP)
    checkpoint.save(pipe, f"{directory}/ckpt", opt, step=3)
    out["stepped"] = {alias[n]: zoo.whole_copy(p) for n, p in pipe.named_parameters()}
    model, inputs, loss_fn, target = zoo.gpt2(batch_size=BATCH)
    again = pipecut.compile(model, inputs, mesh, loss_fn=loss_fn, target=target, plan=pipe.plan,
                            runtime=pipecut.RuntimeOptions(timeout=60))
    opt = torch.optim.AdamW(again.parameters(), lr=LR)
    loaded = checkpoint.load(again, f"{directory}/ckpt", opt)
    out["loaded"] = ({alias[n]: zoo.whole_copy(p) for n, p in again.named_parameters()}, loaded.step,
                     {alias[n]: zoo.whole_copy(opt.state[p]["exp_avg"]) for n, p in again.named_parameters()})
    full = dataclasses.replace(pipe.plan, schedule=pipecut.ScheduleKind.GPIPE, stages=tuple(
        dataclasses.replace(s, recompute=pipecut.Recompute.FULL) for s in pipe.plan.stages))  # the same graph
    tokens = pipecut.TensorParallelOptions(sequence_parallel=True)  # token shards across every cut
    out["recompute"] = _one_step(*zoo.gpt2(batch_size=BATCH), mesh, schedule="gpipe", plan=full, tensor_parallel=tokens)
    out["selective"] = _one_step(*zoo.gpt2(batch_size=BATCH), mesh, plan=pinned.first_block_recomputed(pipe.plan),
                                 tensor_parallel=tokens)
    out["interleaved"] = _one_step(*gpt_example(), mesh, schedule="interleaved-1f1b", tensor_parallel=tokens,
                                   scheduling=pipecut.ScheduleOptions(stages_per_rank=2))
    model, inputs, loss_fn, target = zoo.gpt2(batch_size=BATCH)
    pipe = pipecut.compile(model, inputs, mesh, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                           schedule="1f1b", measure=COUNTED, runtime=pipecut.RuntimeOptions(timeout=60))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(inputs, target)
    out["amp"] = {"loss": loss.detach().clone(), "grads": {alias[n]: zoo.whole_copy(p.grad) for n, p in pipe.named_parameters()}}
    return out


def gpt2_with_dropout(batch_size: int = BATCH, seed: int = 0) -> zoo.Built:
    """GPT-2 as a user builds it: transformers' default dropouts (0.1), so torch.export captures
    a train-mode graph and an eval-mode graph that differ, two programs per stage."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=zoo.VOCAB, n_positions=zoo.SEQ, n_embd=zoo.HIDDEN, n_layer=zoo.LAYERS,
                        n_head=zoo.HEADS, bos_token_id=0, eos_token_id=0)
    ids, target = zoo._tokens(batch_size)
    return GPT2LMHeadModel(config), {"input_ids": ids}, zoo.logits_ce, target


def _eval_of_export_models(rank: int, world: int) -> dict[str, Any]:
    """Eval of an export-captured model over tensor-parallel stages, with and without sequence
    parallelism: before any step, and after a train step (dropout on) and an AdamW step, which
    the eval program must read (it holds the train program's DTensor parameters)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    out: dict[str, Any] = {}
    for sp in (False, True):
        model, inputs, loss_fn, target = gpt2_with_dropout()
        names = canonical_names(model)
        alias = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        pipe = pipecut.compile(model, inputs, mesh, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                               measure=COUNTED, runtime=pipecut.RuntimeOptions(timeout=60),
                               tensor_parallel=pipecut.TensorParallelOptions(sequence_parallel=sp))
        pipe.eval()
        with torch.no_grad():
            loss, outputs = pipe.step(inputs, target, return_outputs=True, all_ranks=True)
        pipe.train()
        pipe.step(inputs, target)
        torch.optim.AdamW(pipe.parameters(), lr=LR).step()
        pipe.eval()
        with torch.no_grad():
            after = pipe.step(inputs, target)
        out[f"sp={sp}"] = {"before": (loss, outputs["logits"]), "after": after,
                           "params": {alias[n]: zoo.whole_copy(p) for n, p in pipe.named_parameters()}}
    return out


@pytest.mark.timeout(600)
def test_eval_of_an_export_model_runs_split_over_the_tensor_group() -> None:
    """Its eval-mode graph, a second program, is split as the train graph is (it was refused)."""
    ranks = run_ranks(_eval_of_export_models, 4, timeout=560, collective_timeout=120)
    model, inputs, loss_fn, target = gpt2_with_dropout()
    names = canonical_names(model)
    with torch.no_grad():
        logits = model.eval()(**inputs).logits
        before = loss_fn(model(**inputs), target)
    for case in ranks[0]:
        stepped = {name: p for got in ranks for name, p in got[case]["params"].items()}
        with torch.no_grad():  # the plain model at the pipeline's weights after its step
            for p in model.parameters():
                p.copy_(stepped[names[id(p)]])
            want = loss_fn(model(**inputs), target)
        assert not torch.equal(want, before)  # the step moved the weights the eval reads
        for r, got in enumerate(ranks):
            loss, outputs = got[case]["before"]
            torch.testing.assert_close(loss, before, atol=ATOL, rtol=RTOL, msg=lambda m, r=r, case=case: f"rank {r} {case}: {m}")
            torch.testing.assert_close(outputs, logits, atol=ATOL, rtol=RTOL, msg=lambda m, r=r, case=case: f"rank {r} {case}: {m}")
            torch.testing.assert_close(got[case]["after"], want, atol=ATOL, rtol=RTOL,
                                       msg=lambda m, r=r, case=case: f"rank {r} {case} after a step: {m}")


def _normwise(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * max(want.double().abs().max().item(), 1e-6), f"{what}: max error {err:.3g}"


@pytest.mark.timeout(600)
def test_tp_composes_with_no_sync_clipping_checkpoints_recompute_interleaving_and_autocast(tmp_path: Any) -> None:
    from safetensors.torch import load_file

    ranks = run_ranks(_compositions, 4, str(tmp_path), timeout=560, collective_timeout=120)
    model, inputs, loss_fn, target = zoo.gpt2(batch_size=2 * BATCH)
    saved = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    for key, value in model.state_dict().items():  # whole tensors, under the model's names
        if key in saved:
            torch.testing.assert_close(saved[key], value, atol=0, rtol=0)
    assert {n for n, _ in model.named_parameters()} <= set(saved)
    names = canonical_names(model)
    for half in (slice(0, BATCH), slice(BATCH, 2 * BATCH)):  # two batches accumulated, as the pipeline
        for mb, t in zip(split_microbatches({"input_ids": inputs["input_ids"][half]}, MICROBATCHES, BATCH),
                         split_microbatches(target[half], MICROBATCHES, BATCH, "target")):
            (loss_fn(model(**mb), t) / MICROBATCHES).backward()
    accumulated = {names[id(p)]: p.grad.clone() for p in model.parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    stepped = {**ranks[0]["stepped"], **ranks[-1]["stepped"]}  # stage 0's and the last stage's
    for got in ranks:
        params, step, exp_avg = got["loaded"]
        assert step == 3 and params.keys() == exp_avg.keys()
        for name, value in params.items():  # the weights and the optimizer state saved, shard by shard
            torch.testing.assert_close(value, stepped[name], atol=0, rtol=0)
            assert exp_avg[name].abs().sum() > 0
    plain, *_ = zoo.gpt2(batch_size=BATCH)
    checkpoint.load_into_model(plain, tmp_path / "ckpt")  # whole tensors, no process group
    plain_names = canonical_names(plain)
    for p in plain.parameters():
        torch.testing.assert_close(p.detach(), stepped[plain_names[id(p)]], atol=0, rtol=0)
    for got in ranks:
        torch.testing.assert_close(got["norm"], norm, atol=ATOL, rtol=RTOL)
        for p in model.parameters():
            key = names[id(p)]
            if key in got["accumulated"]:
                torch.testing.assert_close(got["accumulated"][key], accumulated[key], atol=ATOL, rtol=RTOL)
                torch.testing.assert_close(got["clipped"][key], p.grad, atol=ATOL, rtol=RTOL)
    _check(_reference(*zoo.gpt2(batch_size=BATCH)), [r["recompute"] for r in ranks])
    assert ranks[0]["recompute"]["recompute"] == ["full", "full"]
    _check(_reference(*zoo.gpt2(batch_size=BATCH)), [r["selective"] for r in ranks])
    assert ranks[0]["selective"]["recompute"] == ["selective", "selective"]
    _check(_reference(*gpt_example()), [r["interleaved"] for r in ranks])
    assert len(ranks[0]["interleaved"]["recompute"]) == 4  # two stages per rank
    for scenario in ("recompute", "selective", "interleaved"):  # the residual stream crossed its cuts as token shards
        assert any(wire != spec for r in ranks for spec, wire in r[scenario]["wire"]), scenario
    model, inputs, loss_fn, target = zoo.gpt2(batch_size=BATCH)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _reference(model, inputs, loss_fn, target)
    for r, got in enumerate(ranks):
        _normwise(got["amp"]["loss"], want["loss"], AMP_REL, f"rank {r} autocast loss")
        for name, g in got["amp"]["grads"].items():
            _normwise(g, want["grads"][name], AMP_REL, f"rank {r} autocast grad {name}")


# --- refused before any step, by name ---------------------------------------------------------------
class Odd(nn.Module):
    """63 output features (T = 2 does not divide them); or an op DTensor has no rule for
    (``renorm``) in the split region."""

    def __init__(self, renorm: bool = False) -> None:
        super().__init__()
        self.renorm = renorm
        self.proj = nn.Linear(zoo.HIDDEN, 2 * zoo.HIDDEN if renorm else 63)
        self.out = nn.Linear(self.proj.out_features, zoo.VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.renorm:
            h = torch.renorm(h, 2, 0, 10.0)
        return self.out(torch.relu(h))


def _odd(renorm: bool) -> zoo.Built:
    torch.manual_seed(0)
    return Odd(renorm), (torch.randn(BATCH, zoo.HIDDEN),), F.cross_entropy, torch.randint(0, zoo.VOCAB, (BATCH,))


def _three_heads() -> zoo.Built:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=zoo.VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=zoo.SEQ)
    ids, target = zoo._tokens(BATCH)
    return LlamaForCausalLM(config), {"input_ids": ids}, zoo.logits_ce, target


USER_PLAN = {"blocks.*.0": "column", "blocks.*.2": "row"}
MLP_ONLY = {"model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
            "model.layers.*.mlp.down_proj": "row"}


def _refusals(rank: int, world: int, directory: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    odd_plan = pipecut.TensorParallelOptions(plan={"proj": "column"})
    cases: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "heads": (_three_heads(), mesh, {}),
        "width": (_odd(False), mesh, {"tensor_parallel": odd_plan}),
        "op": (_odd(True), mesh, {}),
        # the experts' grouped product (a transformers op DTensor has no rule for) on token shards
        "sequence": (mixtral(), mesh, {"tensor_parallel": pipecut.TensorParallelOptions(sequence_parallel=True)}),
        # only the MLPs split: attention stays outside every region, on the token shards (the
        # way DeepSeek-V3's MLA attention met sequence parallelism under its own tp_plan)
        "attention": (zoo.llama(batch_size=BATCH), mesh, {"tensor_parallel": pipecut.TensorParallelOptions(
            plan=MLP_ONLY, sequence_parallel=True)}),
        "mesh": (mlp(), init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "xx")), {}),
    }
    out: dict[str, Any] = {}
    for case, ((model, inputs, loss_fn, target), devices, kwargs) in cases.items():
        kwargs.setdefault("runtime", pipecut.RuntimeOptions(timeout=60))
        try:
            pipecut.compile(model, inputs, devices, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                            measure=COUNTED, **kwargs)
            out[case] = "no error"
        except pipecut.PipecutError as e:
            out[case] = f"{type(e).__name__}: {e}"
    model, inputs, loss_fn, target = mlp()
    pipe = pipecut.compile(model, inputs, mesh, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                           measure=COUNTED, runtime=pipecut.RuntimeOptions(timeout=60),
                           tensor_parallel=pipecut.TensorParallelOptions(plan=USER_PLAN))
    out["user plan"] = sorted(n for n, p in pipe.named_parameters() if isinstance(p, DTensor))
    out["recorded"] = pipe.plan.options.tensor_parallel if pipe.plan.options else None
    again = pipecut.compile(model, inputs, mesh, loss_fn=loss_fn, target=target, plan=pipe.plan,
                            runtime=pipecut.RuntimeOptions(timeout=60))  # the plan carries the split asked
    out["replayed"] = sorted(n for n, p in again.named_parameters() if isinstance(p, DTensor))
    pipe.eval()  # symbolic_trace: one program for both modes, split alike
    with torch.no_grad():
        out["eval"] = pipe.step(inputs, target)
    flat = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))  # one replica: no engine by default
    model, inputs, loss_fn, target = mlp()  # a model of its own: FSDP2 shards the modules it calls
    # zero-bubble, which this layout once refused naming FSDP, a default the user never asked for
    one = pipecut.compile(model, inputs, flat, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                          schedule="zero-bubble", measure=COUNTED, runtime=pipecut.RuntimeOptions(timeout=60))
    out["dp1"] = (one.step(inputs, target), one.plan.data_parallel)
    model, inputs, loss_fn, target = mlp()  # "auto" times split stages eager and compiled (apart), keeps one
    auto = pipecut.compile(model, inputs, mesh, loss_fn=loss_fn, target=target, microbatches=MICROBATCHES,
                           measure=pipecut.MeasureOptions(repeats=1, warmup=0, calibration_steps=1),
                           runtime=pipecut.RuntimeOptions(timeout=300, compile_stages="auto"))
    assert auto.plan.options is not None
    out["auto"] = (auto.plan.options.runtime.compile_stages, auto.plan.solver.detail, auto.step(inputs, target),
                   [s.graphs for s in auto.compile_stats])
    return out


@pytest.mark.timeout(600)
def test_what_cannot_be_split_is_refused_by_name_before_any_step(tmp_path: Any) -> None:
    ranks = run_ranks(_refusals, 4, str(tmp_path), timeout=560, collective_timeout=120)
    got = ranks[0]
    assert all(r[k] == got[k] for r in ranks for k in got
               if k not in ("user plan", "replayed", "op", "sequence", "attention", "eval", "dp1"))
    assert "InputError: tensor_parallel=2 (the mesh's 'tp' dimension) must divide the attention heads (3) and " \
           "the KV heads (3)" in got["heads"] and "group sizes that run: 1, 3" in got["heads"]
    assert "InputError: tensor_parallel=2 must divide every split dimension: proj.bias (dimension 0 of size 63), " \
           "proj.weight (dimension 0 of size 63)" in got["width"]
    for r in ranks:  # the stage holding the op names it (either rank of its group); the others stop naming it
        assert re.search(r"stage 0 \(rank [01]\) cannot run split over its tensor-parallel group: node renorm", r["op"])
        assert "Operator aten.renorm.default does not have a sharding strategy" in r["op"]
    for r in ranks:  # Mixtral's experts run on each rank's tokens, in an op DTensor has no rule for
        assert re.search(r"PlanError: stage [01] \(rank [0-3]\) cannot run split over its tensor-parallel group: "
                         r"node grouped_mm\w* \(.*\), on the residual stream's token shards \(sequence parallelism\),"
                         r" failed on DTensors: .* leave TensorParallelOptions\(sequence_parallel=False\)", r["sequence"]), \
            r["sequence"]
    for r in ranks:  # compile_stages="auto" weighs compiled stages under tensor parallelism, and says which it kept:
        # compiled apart, the Mlp's stages have nothing to compile (a lone GELU between its products, a lone
        # residual add after each region end), so eager stays whatever the clock said, and the note says why
        mode, detail, loss, graphs = r["auto"]
        assert (mode, graphs) == (False, []) and "eager stages kept: no stage compiled a graph" in detail, detail
        assert torch.isfinite(loss)
    for r in ranks:  # refused from the graph, before the probe runs anything
        assert re.search(r"stage [01] \(rank [0-3]\) cannot run split over its tensor-parallel group: node "
                         r"scaled_dot_product_attention\w* .*an attention outside every split region", r["attention"]), \
            r["attention"]
        assert "sequence_parallel=False" in r["attention"]
    assert "InputError: the DeviceMesh needs a 'pp' dimension and maybe 'dp' and 'tp' ones" in got["mesh"]
    split = {n.rpartition(".")[0] for r in ranks for n in r["user plan"]}
    assert split == {"blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"}, split  # embed and head stay whole
    assert got["recorded"] == pipecut.TensorParallelOptions(plan=USER_PLAN, size=2)
    assert all(r["replayed"] == r["user plan"] for r in ranks)
    model, inputs, loss_fn, target = mlp()
    for r in ranks:
        torch.testing.assert_close(r["dp1"][0], loss_fn(model(*inputs), target), atol=ATOL, rtol=RTOL)
        assert r["dp1"][1] is None  # nothing to keep in step, so no engine
    with torch.no_grad():
        want = loss_fn(model.eval()(*inputs), target)
    for r in ranks:
        torch.testing.assert_close(r["eval"], want, atol=ATOL, rtol=RTOL)
