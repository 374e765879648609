"""Freezing and unfreezing parameters between steps, after ``compile``, under DDP and FSDP2.

Regression (issue 27): on 2 replicas x 2 stages of a Llama, ``requires_grad_(False)`` on
``model.embed_tokens.weight`` after compile made DDP's second step fail with its own
"Expected to have finished reduction in the prior iteration", and the first step's gradients
were not averaged across replicas: DDP's reducer, built when the parameter was trainable,
waited for a gradient that never came. The data-parallel wrappers are now rebuilt when the
trainable set changes, after every replica of the stage agreed on it
(``pipecut.runtime.grads.data_parallel``).

Each run follows a user's loop: three SGD steps, with one parameter on each stage frozen
before the second step and unfrozen before the third (through ``pipe.named_parameters()``, on
the rank that holds it, every replica alike). The plain model does the same on the full
batch; the replicas' averaged gradients must be its gradients, and a frozen parameter keeps
``.grad`` None as in the plain model. A rank that freezes what its other replica does not is
refused on every rank, naming the parameter, before any gradient is written. Inputs of the
wrong structure are refused on every rank in words (``tests/unit/test_input_errors.py``),
and the pipeline keeps running.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import pipecut
from examples import zoo
from pipecut.errors import InputError, PipelineRuntimeError
from tests.harness import run_ranks
from tests.reference import ATOL, RTOL, assert_named_grads, named_grads

pytestmark = pytest.mark.dist

BATCH = 8
LR = 0.1
FROZEN = ("model.embed_tokens.weight", "model.layers.1.mlp.gate_proj.weight")
"""One parameter of each stage (the split is pinned at ``model.layers.1``)."""
TRAINABLE = [(), FROZEN, ()]
KINDS = ("ddp", "fsdp")
"""Before each of the three steps: the parameters frozen (the others train)."""


def _set_frozen(params: dict[str, torch.nn.Parameter], frozen: tuple[str, ...]) -> None:
    for name in FROZEN:
        if name in params:
            params[name].requires_grad_(name not in frozen)


def _plain() -> list[dict[str, Any]]:
    """The unsplit Llama on the whole batch, freezing as the pipelines do."""
    model, inputs, loss_fn, target = zoo.llama(batch_size=BATCH)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for frozen in TRAINABLE:
        _set_frozen(params, frozen)
        loss = loss_fn(model(**inputs), target)
        loss.backward()
        steps.append({"loss": loss.detach(), "grads": {n: None if p.grad is None else p.grad.clone()
                                                       for n, p in params.items()}})
        opt.step()
        opt.zero_grad()
    return steps


def _ranks(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    share = slice(BATCH // 2 * replica, BATCH // 2 * (replica + 1))
    out: dict[str, Any] = {"runs": {}, "refused": {}}
    plan = None
    for kind in KINDS:
        model, inputs, loss_fn, target = zoo.llama(batch_size=BATCH)
        local, local_target = {"input_ids": inputs["input_ids"][share]}, target[share]
        pipe = pipecut.compile(
            model, local, mesh, loss_fn=loss_fn, target=local_target,
            microbatches=2, schedule="1f1b", data_parallel=kind, plan=plan,
            partition=None if plan else pipecut.PartitionOptions(split=["model.layers.1"]),
            measure=None if plan else pipecut.MeasureOptions(calibration_steps=0, repeats=1, warmup=0),
            runtime=pipecut.RuntimeOptions(timeout=60),
        )
        plan = pipe.plan
        try:  # the wrong structure: refused alike on every rank, in words, and the pipeline runs on
            pipe.step((local["input_ids"],), local_target)
            out["wrong inputs"] = None
        except InputError as e:
            out["wrong inputs"] = str(e)
        params = dict(pipe.named_parameters())
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        steps = []
        for frozen in TRAINABLE:
            _set_frozen(params, frozen)
            loss = pipe.step(local, local_target)
            steps.append({"loss": loss, "grads": named_grads(pipe)})
            opt.step()
            opt.zero_grad()
            # A forward-only step leaves FSDP's parameters gathered (reshard_after_forward=False)
            # with the flags of their last gathering: the next freeze must still take effect.
            pipe.eval_step(local, local_target)
        out["runs"][kind] = {"steps": steps, "stage": pipe.stage}
        # Replica 1 freezes what replica 0 trains: refused on every rank, before any gradient.
        if "model.embed_tokens.weight" in params and replica == 1:
            params["model.embed_tokens.weight"].requires_grad_(False)
        try:
            pipe.step(local, local_target)
            out["refused"][kind] = None
        except PipelineRuntimeError as e:
            out["refused"][kind] = (str(e), any(p.grad is not None for p in pipe.parameters()))
    return out


@pytest.mark.timeout(600)
def test_freeze_and_unfreeze_between_steps_under_ddp_and_fsdp_match_the_plain_model() -> None:
    results = run_ranks(_ranks, 4, timeout=580, collective_timeout=60)
    plain = _plain()
    for kind in KINDS:
        runs = [r["runs"][kind] for r in results]
        assert sorted(run["stage"] for run in runs) == [0, 0, 1, 1]
        for step, ref in enumerate(plain):
            for r, run in enumerate(runs):
                # fp32, the full batch against two replicas of two microbatches each: only the
                # order of additions differs (see tests/reference.py for the tolerances).
                torch.testing.assert_close(run["steps"][step]["loss"], ref["loss"], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, r=r, at=f"{kind} step {step}": f"{at} rank {r} loss: {m}")
            assert_named_grads(ref["grads"], [run["steps"][step]["grads"] for run in runs], f"{kind} step {step}")
        for r, result in enumerate(results):
            assert result["wrong inputs"] is not None and result["wrong inputs"].startswith(
                "step got 1 positional input (tensor[4, 16]); the plan was captured with 1 keyword input "
                "(input_ids): pass them as keywords, a dict {'input_ids': ...}"), result["wrong inputs"]
            refused = result["refused"][kind]
            assert refused is not None, f"{kind}: rank {r} stepped with replicas disagreeing"
            message, wrote = refused
            assert not wrote, f"{kind}: rank {r} wrote gradients before refusing"
            # Every rank, of either stage, names the parameter, who holds it how, and the fix.
            assert "'model.embed_tokens.weight' requires_grad=True on ranks [0], False on ranks [2]" in message, message
            assert "Set it alike on every rank" in message, message
