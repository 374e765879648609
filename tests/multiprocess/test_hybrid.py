"""Beyond one stage per rank: interleaved virtual stages, and pipeline x data parallelism."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import pipecut
from examples import EXAMPLES
from pipecut.core.graph import canonical_names
from pipecut.core.kinds import Recompute, ScheduleKind
from pipecut.errors import InputError, PlanError
from tests.harness import run_ranks
from tests.reference import COUNTED, assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist


def _interleaved(rank: int, world: int, names: list[str]) -> list[dict[str, Any]]:
    out = []
    for name in names:
        model, inputs, loss_fn, target = EXAMPLES[name]()
        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target, microbatches=4,
            schedule="interleaved-1f1b", scheduling=pipecut.ScheduleOptions(stages_per_rank=2),
            runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED,
        )
        loss = pipe.step(inputs, target)
        out.append({"loss": loss, "grads": pipeline_grads(model, pipe), "stages": pipe.stages})
    return out


@pytest.mark.timeout(240)
def test_interleaved_virtual_stages_match_the_unsplit_model() -> None:
    names = ["gpt", "mlp"]
    results = run_ranks(_interleaved, 2, names, timeout=220)
    assert results[0][0]["stages"] == (0, 2) and results[1][0]["stages"] == (1, 3)
    for i, name in enumerate(names):
        ref_loss, ref_grads = reference(EXAMPLES[name], 4, per_microbatch=False)
        assert_parity(ref_loss, ref_grads, [r[i] for r in results])


def _plain_two_steps(lr: float) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Loss and gradients of the unsplit GPT on the whole batch of 16, for two SGD steps."""
    model, inputs, loss_fn, target = EXAMPLES["gpt"]()
    names = canonical_names(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for _ in range(2):
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        out.append((loss.detach(), {names[id(p)]: p.grad.clone() for p in model.parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter name -> its canonical name (read before FSDP swaps the parameters)."""
    first = canonical_names(model)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def _full_grads(alias: dict[str, str], pipe: Any) -> dict[str, torch.Tensor]:
    """This rank's gradients by canonical name; FSDP shards gathered (collective over "dp")."""
    out = {}
    for name, p in pipe.named_parameters():
        g = p.grad
        out[alias[name]] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


HYBRID = [("ddp", "1f1b"), ("ddp", "gpipe"), ("fsdp", "1f1b"), ("fsdp", "gpipe"),
          ("ddp", "interleaved-1f1b"), ("fsdp", "interleaved-1f1b"),  # two wrappers per rank
          ("ddp", "zero-bubble"), ("fsdp", "zero-bubble"), ("ddp", "zbv"), ("fsdp", "zbv"),
          ("ddp", "1f1b+full"), ("fsdp", "zero-bubble+full")]  # +full: every stage recomputes
VIRTUAL = {"interleaved-1f1b": 2, "zbv": 2}  # stages per rank
LR = 0.1


def _hybrid(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    half = slice(8 * replica, 8 * replica + 8)  # each replica trains on its own half of 16
    out: dict[str, Any] = {"replica": replica, "runs": [], "errors": []}
    plans: dict[tuple[str, int], Any] = {}
    for kind, spec in HYBRID:
        schedule, _, full = spec.partition("+")
        model, inputs, loss_fn, target = EXAMPLES["gpt"]()
        local_inputs, local_target = (inputs[0][half],), target[half]
        alias = _aliases(model)
        virtual = VIRTUAL.get(schedule, 1)
        plan = plans.get((schedule, virtual))  # rank 0 profiles once per layout; then replay
        if full:  # the same split, every stage recomputing its whole forward in backward
            plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=Recompute.FULL)
                                                          for s in plan.stages))
        pipe = pipecut.compile(
            model, local_inputs, mesh, loss_fn=loss_fn, target=local_target,
            microbatches=4, schedule=schedule, plan=plan, data_parallel=kind,
            scheduling=pipecut.ScheduleOptions(stages_per_rank=virtual),
            runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED,
        )
        plans.setdefault((schedule, virtual), pipe.plan)
        if virtual == 1:
            for other in ("1f1b", "gpipe", "zero-bubble"):
                plans.setdefault((other, 1), dataclasses.replace(pipe.plan, schedule=ScheduleKind(other)))
        fired: list[str] = []  # the backward passes running when DDP reduced
        if kind == "ddp":
            _watch_reductions(pipe, fired)
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        steps = []
        for _ in range(2):
            loss = pipe.step(local_inputs, local_target)
            steps.append({"loss": loss, "grads": _full_grads(alias, pipe)})
            opt.step()
            opt.zero_grad()
        sharded = [p.to_local().shape[0] * 2 == p.shape[0] for p in pipe.parameters()
                   if isinstance(p, DTensor) and p.shape[0] % 2 == 0]
        out["runs"].append({"steps": steps, "stages": pipe.stages, "fired": fired,
                            "recompute": {st.recompute for st in pipe.plan.stages},
                            "sharded": sharded})
    # One model compiled twice under FSDP: each pipeline shards its own copies of the modules,
    # so the first still trains after the second is made, and the model keeps its plain tensors
    # (fully_shard swapped the model's own parameter slots before).
    model, inputs, loss_fn, target = EXAMPLES["gpt"]()
    alias, before = _aliases(model), {n: p.detach().clone() for n, p in model.named_parameters()}
    twice = [pipecut.compile(model, (inputs[0][half],), mesh, loss_fn=loss_fn, target=target[half], microbatches=4,
                             plan=plans[("1f1b", 1)], data_parallel="fsdp",
                             runtime=pipecut.RuntimeOptions(timeout=60)) for _ in range(2)]
    out["twice"] = [{"loss": pipe.step((inputs[0][half],), target[half]), "grads": _full_grads(alias, pipe)}
                    for pipe in reversed(twice)]
    out["model"] = {n: "DTensor" if isinstance(p, DTensor) else bool(torch.equal(p, before[n]))
                    for n, p in model.named_parameters()}
    model, inputs, loss_fn, target = EXAMPLES["gpt"]()
    for devices, kwargs in [(world, {"data_parallel": "fsdp"}),
                            (mesh, {"data_parallel": "zero"}),
                            (mesh, {"data_parallel": pipecut.DataParallelOptions(kind="ddp", replicas=4)})]:
        try:
            pipecut.compile(
                model, (inputs[0][half],), devices, loss_fn=loss_fn,
                target=target[half], microbatches=4, runtime=pipecut.RuntimeOptions(timeout=60),
                **kwargs,
            )
            out["errors"].append("no error")
        except (InputError, PlanError) as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
    return out


def _watch_reductions(pipe: Any, fired: list[str]) -> None:
    """Record, each time DDP launches a bucket's all-reduce, which backward pass runs (as the
    schedules print it: "3B", "3W")."""
    for worker in pipe.workers.values():
        current: list[Any] = [None]
        sync = worker.grad_sync

        class Watch:
            def before(self, kind: Any, mb: int, sync: Any = sync, current: list[Any] = current) -> None:
                current[0] = f"{mb}{kind.value}"
                sync.before(kind, mb)

            def after(self, kind: Any, mb: int, sync: Any = sync) -> None:
                sync.after(kind, mb)

        def hook(state, bucket, current=current):  # DDP checks annotations: leave them off
            fired.append(current[0])
            return allreduce_hook(state, bucket)

        worker.grad_sync = Watch()
        worker.call.ddp.register_comm_hook(worker.call.ddp.process_group, hook)


@pytest.mark.timeout(300)
def test_ddp_and_fsdp_two_stages_times_two_replicas_match_the_whole_batch() -> None:
    results = run_ranks(_hybrid, 4, timeout=280)
    assert sorted(r["replica"] for r in results) == [0, 0, 1, 1]
    plain = _plain_two_steps(LR)
    for i, (kind, spec) in enumerate(HYBRID):
        schedule = spec.partition("+")[0]
        runs = [r["runs"][i] for r in results]
        want = {Recompute.FULL} if spec.endswith("+full") else {Recompute.NONE}
        assert all(run["recompute"] == want for run in runs), (spec, [run["recompute"] for run in runs])
        held = {"interleaved-1f1b": [(0, 2), (0, 2), (1, 3), (1, 3)],
                "zbv": [(0, 3), (0, 3), (1, 2), (1, 2)]}.get(schedule, [(0,), (0,), (1,), (1,)])
        assert sorted(run["stages"] for run in runs) == held
        for step, (ref_loss, ref_grads) in enumerate(plain):
            # The reference is the unsplit model on all 16 samples; after step 0 both have taken
            # one SGD step, so step 1 also checks that the optimizer saw the averaged gradients.
            # Tolerances as in tests/reference.py: only summation order differs.
            try:
                assert_parity(ref_loss, ref_grads, [run["steps"][step] for run in runs])
            except AssertionError as e:
                raise AssertionError(f"{kind} {spec} step {step}: {e}") from e
        if kind == "ddp":
            # DDP reduces only in each stage's last backward pass: microbatch 0 for GPipe
            # (backwards in reverse), 3 for 1F1B and interleaved 1F1B, and under zero-bubble and
            # ZBV the weight pass of microbatch 3 (never an input pass, which writes no gradient).
            last = {"gpipe": "0B", "zero-bubble": "3W", "zbv": "3W"}.get(schedule, "3B")
            for run in runs:
                assert run["fired"] and set(run["fired"]) == {last}, (kind, schedule, run["fired"])
        else:  # FSDP: every parameter with an even first dimension is split in two halves
            for run in runs:
                assert run["sharded"] and all(run["sharded"]), run["sharded"]
    for r in results:
        assert set(r["model"].values()) == {True}, r["model"]  # plain and unchanged on every rank
    for i in range(2):  # the second pipeline, then the first
        assert_parity(plain[0][0], plain[0][1], [r["twice"][i] for r in results])
    for r in results:
        no_dp, unknown, replicas = r["errors"]
        assert "InputError: DataParallelOptions(replicas=4) but the devices give 2 replica(s)" in replicas
        assert "InputError: data_parallel='fsdp' needs replicas" in no_dp
        assert "InputError: unknown data_parallel 'zero'; choose one of ['ddp', 'zero1', 'fsdp', 'auto']" in unknown
