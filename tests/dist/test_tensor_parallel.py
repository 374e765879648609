"""Tensor-parallel stages (issue 28): a ("pp", "tp") or ("dp", "pp", "tp") DeviceMesh, each
stage's layers split over its tensor group as DTensors, against the plain model in one process.

Per model, one step of the pipeline and one of the plain model (the mean of the microbatch
losses, the same split into microbatches): the loss on every rank, every gradient gathered to
its full tensor (each parameter must come from some rank), and every parameter after one AdamW
step. Scenarios share forks: forking is cheap, compiling is not.

Tolerances: float32. A split product sums its partial results across the group (all-reduce)
instead of in one kernel, and the pipeline runs the captured ATen graph while the reference runs
the eager modules, so the same math is grouped differently: differences are rounding, ~1e-7
relative. ``atol=1e-5, rtol=1e-4`` (as tests/dist/test_zoo.py) leaves two orders of margin and
is far below any real error (a missing partial sum or a wrong shard is off by > 1e-2). After
AdamW, whose first step moves each weight by ~lr·sign(g), a gradient near zero can flip sign
with rounding: parameters are compared with ``atol`` = 2·lr·1e-2 ... in practice they agree to
1e-6; ``atol=1e-4`` with lr=1e-3 bounds the error to a tenth of one step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import pipecut
from examples import zoo
from pipecut.core.batching import split_microbatches
from pipecut.core.graph import canonical_names
from tests.harness import run_ranks
from tests.reference import COUNTED

pytestmark = pytest.mark.dist

ATOL, RTOL = 1e-5, 1e-4
LR = 1e-3
PARAM_ATOL = 1e-4
MICROBATCHES = 2
BATCH = 4


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


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
    grads = {alias[n]: _full(p.grad) for n, p in named if p.grad is not None}
    split = sorted(alias[n] for n, p in named if isinstance(p, DTensor))
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    opt.step()
    params = {alias[n]: _full(p) for n, p in named}
    return {"loss": loss.detach().clone(), "grads": grads, "params": params, "split": split}


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
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    return {"loss": total, "grads": grads, "params": {names[id(p)]: p.detach().clone() for p in model.parameters()}}


def _check(want: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for r, got in enumerate(ranks):
        if want["loss"] is not None:
            torch.testing.assert_close(got["loss"], want["loss"], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, r=r: f"rank {r} loss: {m}")
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
        max_position_embeddings=zoo.SEQ, use_cache=False, attention_dropout=0.0, attn_implementation="eager",
        router_aux_loss_coef=0.0,
    )
    model = MixtralForCausalLM(config)
    ids, target = zoo._tokens(batch_size)
    return model, {"input_ids": ids}, zoo.logits_ce, target


MODELS = {"llama": zoo.llama, "gpt2": zoo.gpt2, "mixtral": mixtral, "mlp": mlp}


def _pp_tp(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    out = {}
    for name in names:
        out[name] = _one_step(*MODELS[name](batch_size=BATCH), mesh)
    return out


@pytest.fixture(scope="module")
def pp2_tp2() -> list[dict[str, Any]]:
    return run_ranks(_pp_tp, 4, list(MODELS), timeout=600, collective_timeout=120)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_pp2_matches_the_plain_model(pp2_tp2: list[dict[str, Any]], name: str) -> None:
    _check(_reference(*MODELS[name](batch_size=BATCH)), [r[name] for r in pp2_tp2])
    assert pp2_tp2[0][name]["split"], "no parameter was split"


# --- D x T x K: FSDP2 over "dp" ------------------------------------------------------------------
def _dp_pp_tp(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    replica = mesh.get_local_rank("dp")
    model, inputs, loss_fn, target = zoo.llama(batch_size=2 * BATCH)
    half = slice(BATCH * replica, BATCH * (replica + 1))  # each replica trains on its half
    got = _one_step(model, {"input_ids": inputs["input_ids"][half]}, loss_fn, target[half], mesh, data_parallel="fsdp")
    return {**got, "replica": replica}


@pytest.mark.timeout(600)
def test_dp2_tp2_pp2_with_fsdp_matches_the_whole_batch() -> None:
    """8 ranks: 2 replicas (FSDP2 over "dp") x 2 stages x 2-way tensor groups. Gradients are
    averaged over the replicas, so they equal the plain model's over the whole batch in 4
    microbatches; each replica's loss is its half's."""
    ranks = run_ranks(_dp_pp_tp, 8, timeout=560, collective_timeout=120)
    model, inputs, loss_fn, target = zoo.llama(batch_size=2 * BATCH)
    want = _reference(model, inputs, loss_fn, target, microbatches=2 * MICROBATCHES)
    losses = {r["replica"]: r["loss"] for r in ranks}
    torch.testing.assert_close((losses[0] + losses[1]) / 2, want["loss"], atol=ATOL, rtol=RTOL)
    _check({**want, "loss": None}, ranks)
