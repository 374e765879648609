"""Zero-bubble and ZBV with DDP and FSDP2 replicas, on the transformers Llama and GPT-2.

DP 2 x PP 2 (4 ranks), each replica on its half of the batch, against the plain model on the
whole batch, through a user's loop of three SGD steps:

1. a step with its gradients clipped (``pipe.clip_grad_norm_``): loss, norm and every gradient;
2. gradient accumulation: one step under ``pipe.no_sync()``, then a reducing step; the
   gradients are both steps' sum, averaged over the replicas once;
3. a step with one parameter frozen on the ranks that hold it: it gets no gradient;
4. a last, smaller batch of 7, split 4 and 3: the replicas' gradients are weighted by their
   shares, so they are the whole batch's mean (a batch leaving a replica no sample is refused,
   on every rank alike).

GPT-2 ties its input embedding to its head: under ZBV's V the first and the last stage sit on
one rank and share that parameter, so FSDP2 wraps both as one unit
(``pipecut.runtime.grads.data_parallel``). The weight pass's gradients reach the wrappers'
reductions (DDP: the reducer armed before the step's last weight pass; FSDP2: its post-backward
after it); a reduction missed or done early shows as gradients off by the other replica's half.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import pipecut
from examples import zoo
from pipecut.errors import InputError
from tests.harness import run_ranks
from tests.reference import ATOL, COUNTED, RTOL, assert_named_grads, named_grads

pytestmark = pytest.mark.dist

BATCH = 8
M = 4
LR = 0.1
CLIP = 0.5
LAST = 7
"""The last batch: 7 of the 8 samples, 4 on one replica and 3 on the other."""
FROZEN = {"llama": "model.layers.0.mlp.gate_proj.weight", "gpt2": "transformer.h.1.attn.c_attn.weight"}
"""Per model, the parameter frozen before the third step."""
CASES = [(model, kind, schedule) for model in ("llama", "gpt2") for schedule in ("zero-bubble", "zbv")
         for kind in ("ddp", "fsdp")]


def _build(name: str) -> Any:
    return getattr(zoo, name)(batch_size=BATCH)


def _ranks(rank: int, world: int) -> list[dict[str, Any]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    share = slice(BATCH // 2 * replica, BATCH // 2 * (replica + 1))
    plans: dict[tuple[str, str], Any] = {}
    out = []
    for name, kind, schedule in CASES:
        model, inputs, loss_fn, target = _build(name)
        local, local_target = {"input_ids": inputs["input_ids"][share]}, target[share]
        pipe = pipecut.compile(
            model, local, mesh, loss_fn=loss_fn, target=local_target, microbatches=M,
            schedule=schedule, data_parallel=kind, plan=plans.get((name, schedule)), measure=COUNTED,
            scheduling=pipecut.ScheduleOptions(stages_per_rank=2 if schedule == "zbv" else 1),
            runtime=pipecut.RuntimeOptions(timeout=90),
        )
        plans[(name, schedule)] = pipe.plan
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        steps: list[dict[str, Any]] = []
        loss = pipe.step(local, local_target)
        norm = pipe.clip_grad_norm_(CLIP)
        steps.append({"loss": loss, "norm": norm, "grads": named_grads(pipe)})
        opt.step()
        opt.zero_grad()
        with pipe.no_sync():
            first = pipe.step(local, local_target)
        second = pipe.step(local, local_target)
        steps.append({"loss": torch.stack([first, second]), "grads": named_grads(pipe)})
        opt.step()
        opt.zero_grad()
        params = dict(pipe.named_parameters())
        if FROZEN[name] in params:
            params[FROZEN[name]].requires_grad_(False)
        steps.append({"loss": pipe.step(local, local_target), "grads": named_grads(pipe)})
        opt.zero_grad()
        # a last, smaller batch of 7, split 4 and 3 over the replicas
        rows = slice(4 * replica, min(4 * replica + 4, LAST))
        steps.append({"loss": pipe.step({"input_ids": inputs["input_ids"][rows]}, target[rows]), "grads": named_grads(pipe)})
        empty = None
        if (name, kind, schedule) == CASES[0]:  # a batch that leaves replica 1 no sample: refused on every rank
            rows = slice(0, 2) if replica == 0 else slice(0, 0)
            try:
                pipe.step({"input_ids": inputs["input_ids"][rows]}, target[rows])
            except InputError as e:
                empty = str(e)
        out.append({"steps": steps, "stages": pipe.stages, "empty": empty})
    return out


def _plain(name: str) -> list[dict[str, Any]]:
    """The unsplit model on the whole batch, through the same three steps."""
    model, inputs, loss_fn, target = _build(name)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def grads() -> dict[str, torch.Tensor | None]:
        return {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}

    loss = loss_fn(model(**inputs), target)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    steps: list[dict[str, Any]] = [{"loss": loss.detach(), "norm": norm, "grads": grads()}]
    opt.step()
    opt.zero_grad()
    losses = []
    for _ in range(2):  # accumulated: the same batch twice at the same weights
        loss = loss_fn(model(**inputs), target)
        loss.backward()
        losses.append(loss.detach())
    steps.append({"loss": torch.stack(losses), "grads": grads()})
    opt.step()
    opt.zero_grad()
    params[FROZEN[name]].requires_grad_(False)
    loss = loss_fn(model(**inputs), target)
    loss.backward()
    steps.append({"loss": loss.detach(), "grads": grads()})
    opt.zero_grad()
    loss = loss_fn(model(input_ids=inputs["input_ids"][:LAST]), target[:LAST])
    loss.backward()
    steps.append({"loss": loss.detach(), "grads": grads()})
    return steps


@pytest.mark.timeout(600)
def test_zero_bubble_and_zbv_with_ddp_and_fsdp_match_the_plain_model() -> None:
    results = run_ranks(_ranks, 4, timeout=580, collective_timeout=90)
    plain = {name: _plain(name) for name in FROZEN}
    for i, (name, kind, schedule) in enumerate(CASES):
        at = f"{name} {kind} {schedule}"
        runs = [r[i] for r in results]
        held = [(0, 3), (0, 3), (1, 2), (1, 2)] if schedule == "zbv" else [(0,), (0,), (1,), (1,)]
        assert sorted(run["stages"] for run in runs) == held, at
        if i == 0:
            for run in runs:
                assert run["empty"] and "step got batches of [2, 0] samples on the 2 data-parallel replicas" in run["empty"], run
        for step, ref in enumerate(plain[name]):
            for r, run in enumerate(runs):
                got = run["steps"][step]
                # fp32; the whole batch against two replicas of four microbatches: only the order
                # of additions differs (tests/reference.py explains the tolerances).
                torch.testing.assert_close(got["loss"], ref["loss"], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, r=r, s=step, at=at: f"{at} step {s} rank {r} loss: {m}")
                if "norm" in ref:
                    torch.testing.assert_close(got["norm"], ref["norm"], rtol=RTOL, atol=ATOL,
                                               msg=lambda m, r=r, at=at: f"{at} rank {r} clipped norm: {m}")
            assert_named_grads(ref["grads"], [run["steps"][step]["grads"] for run in runs], f"{at} step {step}")


def _cluster_plan_on_cpu(rank: int, world: int, plan: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    share = slice(BATCH // 2 * replica, BATCH // 2 * (replica + 1))
    model, inputs, loss_fn, target = _build("llama")
    pipe = pipecut.compile(model, {"input_ids": inputs["input_ids"][share]}, mesh, loss_fn=loss_fn,
                           target=target[share], plan=plan, runtime=pipecut.RuntimeOptions(timeout=90))
    loss = pipe.step({"input_ids": inputs["input_ids"][share]}, target[share])
    return {"loss": loss, "grads": named_grads(pipe), "schedule": pipe.plan.schedule.value,
            "data_parallel": pipe.plan.data_parallel}


@pytest.mark.timeout(600)
def test_a_cluster_plan_where_zero_bubble_with_replicas_wins_runs_at_parity() -> None:
    """The cluster planner weighs every schedule and D x K for two nodes of two H100s and picks
    zero-bubble over two FSDP replicas of two stages; that very plan, replayed on 4 CPU ranks,
    steps at parity with the plain model (it was a run pipecut's runtime refused)."""
    from pipecut.planning.cluster.plan import plan_cluster

    model, inputs, loss_fn, target = _build("llama")
    plan = plan_cluster(model, inputs, "2x2xH100-SXM", microbatches=M, schedule="auto", tensor_parallel=1,
                        partition=pipecut.PartitionOptions(recompute="none"), loss_fn=loss_fn, target=target)
    assert plan.schedule is pipecut.ScheduleKind.ZERO_BUBBLE and plan.placement is not None
    assert (plan.placement.replicas, plan.num_stages) == (2, 2)
    assert plan.data_parallel == pipecut.DataParallelOptions(kind="fsdp", replicas=2)
    ranks = run_ranks(_cluster_plan_on_cpu, 4, plan.to_json(), timeout=580, collective_timeout=90)
    loss = loss_fn(model(**inputs), target)
    loss.backward()
    for r, got in enumerate(ranks):
        assert (got["schedule"], got["data_parallel"]) == ("zero-bubble", plan.data_parallel)
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, r=r: f"rank {r}: {m}")
    assert_named_grads({n: p.grad for n, p in model.named_parameters()}, [g["grads"] for g in ranks], "cluster plan")


def _unused_under_ddp(rank: int, world: int) -> dict[str, Any]:
    from examples.architectures import ARCHITECTURES

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    out: dict[str, Any] = {}
    for frozen in (True, False):  # the refused step tears the process group down: last
        model, inputs, loss_fn, target = ARCHITECTURES["clip"](batch_size=BATCH)
        share = slice(BATCH // 2 * replica, BATCH // 2 * (replica + 1))
        x, y = {k: v[share] for k, v in inputs.items()}, target[share]
        pipe = pipecut.compile(model, x, mesh, loss_fn=loss_fn, target=y, microbatches=2, data_parallel="ddp",
                               measure=COUNTED, runtime=pipecut.RuntimeOptions(timeout=60))
        if frozen:  # what the refusal asks for
            for name, p in pipe.named_parameters():
                if "post_layernorm" in name:
                    p.requires_grad_(False)
        try:
            out[f"frozen={frozen}"] = {"loss": pipe.step(x, y), "grads": named_grads(pipe)}
        except pipecut.PipecutError as e:
            out[f"frozen={frozen}"] = str(e)
    return out


@pytest.mark.timeout(600)
def test_ddp_refuses_a_parameter_off_the_loss_path_and_runs_with_it_frozen() -> None:
    """CLIP's image classifier computes its vision tower's post_layernorm but never uses it:
    DDP's reducer waited for those gradients and left their bucket unreduced, silently (the
    replicas' gradients differed by 3e-2, found by the zoo's DDP column). The step is refused
    naming them; frozen, it matches the plain model with them frozen."""
    from examples.architectures import ARCHITECTURES

    ranks = run_ranks(_unused_under_ddp, 4, timeout=580, collective_timeout=90)
    holders = [r["frozen=False"] for r in ranks if "post_layernorm" in str(r["frozen=False"])]
    assert holders and all("data_parallel='ddp' cannot average this stage's gradients: "
                           "vision_model.post_layernorm.weight" in h and "requires_grad_(False)" in h for h in holders)
    model, inputs, loss_fn, target = ARCHITECTURES["clip"](batch_size=BATCH)
    for name, p in model.named_parameters():
        if "post_layernorm" in name:
            p.requires_grad_(False)
    losses = [loss_fn(model(**{k: v[rows] for k, v in inputs.items()}), target[rows]) / 4
              for rows in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8))]  # the replicas' microbatches
    sum(losses).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    for r, got in enumerate(ranks):
        torch.testing.assert_close(got["frozen=True"]["loss"], sum(losses).detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, r=r: f"rank {r}: {m}")
    assert_named_grads(want, [g["frozen=True"]["grads"] for g in ranks], "clip frozen")
