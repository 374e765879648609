"""Running one fuzzer configuration: its batches, its plan (made in the driver, before the
ranks fork) and the training loop each rank runs.

The loop is the README's: ``steps`` optimizer steps of AdamW, each after ``accumulation``
``pipe.step`` calls (all but the last under ``pipe.no_sync()`` when drawn), clipped with
``pipe.clip_grad_norm_``, under autocast (fp16 with ``pipe.grad_scaler()``), with an eval step
under ``no_grad`` between optimizer steps when drawn, and one parameter frozen for step 1 and
trainable again for step 2 when drawn. The model is cast to the drawn parameter dtype (float
inputs follow) and built and run under the drawn default dtype. A rank returns what the
reference check compares: every loss, every gradient (before clipping), every weight after
each step, the clipping norms, the eval steps' losses and outputs, and the buffers and state
dict at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pipecut
from examples.zoo import whole_copy
from pipecut.capture import as_planned, capture, fingerprint
from pipecut.capture.modes import describe_graph
from pipecut.core.batching import first_microbatch
from pipecut.core.kinds import ScheduleKind
from pipecut.ir import ChunkedNode, DeviceSpec, Plan
from pipecut.passes.partition.chain import is_unit
from pipecut.passes.partition.solve import partition_costs
from pipecut.passes.rewrite.chunk_rows import piece_names
from pipecut.runtime.pipeline import Pipeline
from tests.fuzz_config import Config
from tests.fuzz_models import MODELS

ADAMW = {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.01}
"""eps 1e-3 (not 1e-8): Adam divides by sqrt(v) + eps, so a gradient error d changes an update
by at most lr * d / eps; with 1e-8 a few ulps of difference on a near-zero gradient would move
a weight by up to 2 * lr, hiding a real difference under the noise of a faithful run."""
SCALE = 2.0**8
"""The fp16 GradScaler's initial scale: no overflow in these models' gradients."""
NO_SYNC = hasattr(Pipeline, "no_sync")
"""Whether this pipecut has ``pipe.no_sync()`` (the fuzzer draws it only then)."""
SHORTER = 3
"""Positions dropped from a shorter last sequence."""
MEASURE = pipecut.MeasureOptions(estimate="A100-80GB")
"""How the driver's plans and compile's own are costed: counted on fake tensors and priced on a
fixed device profile, no clock. A configuration then plans the same split on every run whatever
the machine's load, so the order of gradient sums (and an AdamW step's last ulps) is repeatable
and a failure replays from its configuration alone."""
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def default_dtype(cfg: Config) -> Any:
    """``torch.set_default_dtype`` of ``cfg`` inside, the previous one restored after (forked
    ranks run many configurations one after the other)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[cfg.default_dtype])
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build(cfg: Config) -> nn.Module:
    """The model of ``cfg`` with its parameters (and float buffers) in the drawn dtype; call
    under :func:`default_dtype`."""
    model = MODELS[cfg.model].build(cfg.seed, cfg.attention).to(DTYPES[cfg.dtype])
    if cfg.dtype == "float64":
        _eager_experts(model)
    return model


def _eager_experts(model: nn.Module) -> None:
    """Mixture-of-experts layers run transformers' loop over the experts: its default,
    ``torch.nn.functional.grouped_mm``, has no float64 kernel, and the plain model itself fails
    ("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"; fuzz campaign
    2026-11-28, 3 of 132 configurations)."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) not in (None, "eager"):
        config._experts_implementation = "eager"  # type: ignore[union-attr]  # sets the sub-configs too


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value.to(dtype) if value.is_floating_point() else value


@dataclasses.dataclass
class Trail:
    """Where a rank's loop is, so that a PipecutError can be judged: a refusal where the run
    meets something for the first time (compile, the first step, the first clip or eval, the
    smaller last batch, the step after a freeze or an unfreeze), a bug where it repeats a call
    that passed before."""

    at: str = "compile"
    kind: tuple[Any, ...] = ("compile",)
    novel: bool = True
    seen: set[tuple[Any, ...]] = dataclasses.field(default_factory=set)

    def enter(self, at: str, *kind: Any) -> None:
        self.at, self.kind, self.novel = at, kind, kind not in self.seen
        self.seen.add(kind)


def batch(cfg: Config, step: int, micro: int, *, evaluation: bool = False) -> tuple[Any, torch.Tensor, int]:
    """The global batch (every replica's rows) of optimizer step ``step``, accumulation step
    ``micro``: (inputs, target, normalizer: the target's valid entries)."""
    spec = MODELS[cfg.model]
    replicas = 2 if cfg.data_parallel != "none" else 1
    rows, seq = cfg.batch, spec.seq or 0
    last = step == cfg.steps - 1 and not evaluation
    if last and cfg.last == "fewer_rows":
        rows = max(1, rows - cfg.rows + 1)
    if last and cfg.last == "one_row":
        rows = 1
    if last and cfg.last == "shorter_seq":
        seq -= SHORTER
    seed = cfg.seed * 10_000 + 100 * step + micro + (50 if evaluation else 0)
    inputs, target = spec.data(rows * replicas, seed, seq)
    inputs = _cast(inputs, DTYPES[cfg.dtype])
    if cfg.reduction == "sum":  # padding, so the normalizer differs from the rows
        target = target.clone()
        target.view(-1)[1::3] = -100
    return inputs, target, int((target != -100).sum())


def share(value: Any, replica: int, replicas: int) -> Any:
    """Replica ``replica``'s equal slice of every batched tensor in ``value``."""
    if isinstance(value, dict):
        return {k: share(v, replica, replicas) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(share(v, replica, replicas) for v in value)
    rows = value.shape[0] // replicas
    return value[replica * rows : (replica + 1) * rows]


def autocast(cfg: Config) -> Any:
    if cfg.autocast == "off":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if cfg.autocast == "bf16" else torch.float16)


def loss_fn(cfg: Config) -> Any:
    spec = MODELS[cfg.model]
    return spec.loss if cfg.reduction == "mean" else spec.loss_sum


# --- plans, made once in the driver -----------------------------------------------------------


def make_plan(cfg: Config, folder: Path) -> Plan | str | None:
    """What compile's ``plan=`` gets: None (compile plans), a Plan, or a JSON path."""
    if cfg.plan in ("auto", "split"):
        return None
    with default_dtype(cfg):
        return _make_plan(cfg, folder)


def _make_plan(cfg: Config, folder: Path) -> Plan | str:
    model = build(cfg)
    inputs, target, _ = batch(dataclasses.replace(cfg, data_parallel="none"), 0, 0)
    common = dict(loss_fn=loss_fn(cfg), target=target, microbatches=cfg.microbatches,
                  schedule=cfg.schedule, measure=MEASURE,
                  scheduling=pipecut.ScheduleOptions(stages_per_rank=cfg.stages_per_rank))
    whole = pipecut.PartitionOptions(heavy_pieces=False)
    if cfg.plan == "heavy":
        return _heavy_plan(cfg, model, inputs)
    if cfg.plan == "memory":
        plain = pipecut.plan(model, inputs, cfg.ranks, partition=whole, **common)
        cap = int(max(s.peak_memory_bytes for s in plain.stages) * 0.8)  # no plain split fits
        devices = [DeviceSpec(name=f"cpu{r}", memory_bytes=cap) for r in range(cfg.ranks)]
        return pipecut.plan(
            model, inputs, devices, partition=dataclasses.replace(whole, ilp_time_limit=2.0),
            **common,
        )
    plan = pipecut.plan(
        model, inputs, cfg.ranks, partition=dataclasses.replace(whole, split=tuple(cfg.split)),
        **common,
    )
    plan = _recompute(plan, cfg.recompute, MODELS[cfg.model].blocks)
    if cfg.plan == "json":
        path = folder / f"plan-{abs(hash(cfg))}.json"
        plan.to_json(path)
        return str(path)
    return plan


def _recompute(plan: Plan, how: str, prefix: str) -> Plan:
    """Every stage recomputing its whole forward (full), or its first block ``prefix``.N
    (selective; stages without such a block keep all activations)."""
    from tests.reference import recompute_blocks, recompute_whole

    return {"none": plan, "full": recompute_whole(plan), "selective": recompute_blocks(plan, prefix, 1)}[how]


def _heavy_plan(cfg: Config, model: torch.nn.Module, inputs: Any) -> Plan:
    """The head in one piece per rank, each piece far heavier than the rest (as in
    tests/multiprocess/test_chunked_head.py), so the pieces land on different stages."""
    head = MODELS[cfg.model].head
    assert head is not None
    chunks = (ChunkedNode(node=head, pieces=cfg.ranks),)
    size, first = first_microbatch(inputs, cfg.microbatches)
    captured = capture(model, first)
    rewritten = as_planned(captured, chunks)
    pieces = set(piece_names(head, cfg.ranks)[1])
    rows = tuple(
        dataclasses.replace(n, forward_ms=30.0 if n.name in pieces else 0.1, backward_ms=0.1) if is_unit(n) else n
        for n in describe_graph(rewritten, rewritten.flatten_inputs(first))
    )
    plan = partition_costs(rows, devices=cfg.ranks, microbatches=cfg.microbatches, batch_size=size,
                           schedule=ScheduleKind(cfg.schedule), fingerprint=fingerprint(captured.gm),
                           capture=captured.method, inputs=captured.input_names)
    return dataclasses.replace(plan, chunked=chunks)


# --- the loop on one rank ---------------------------------------------------------------------


def run_config(rank: int, world: int, cfg: Config, plan: Plan | str | None, timeout: float,
               trail: Trail | None = None) -> dict[str, Any]:
    """Compile ``cfg`` on this rank and run its training loop; what :mod:`tests.fuzz_check`
    compares. ``trail`` follows where the loop is (see :class:`Trail`)."""
    with default_dtype(cfg):
        return _train(cfg, *_compile(cfg, plan, timeout), trail or Trail())


def _compile(cfg: Config, plan: Plan | str | None, timeout: float) -> tuple[Pipeline, int, int]:
    """This rank's pipeline, its replica and the replica count."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas, replica, devices = 1, 0, cfg.ranks
    if cfg.data_parallel != "none":
        mesh = init_device_mesh("cpu", (2, cfg.ranks), mesh_dim_names=("dp", "pp"))
        replicas, replica, devices = 2, mesh.get_local_rank("dp"), mesh
    model = build(cfg)
    inputs, target, _ = batch(cfg, 0, 0)
    split = tuple(cfg.split) if cfg.plan == "split" else None
    planning = {} if plan is not None else dict(
        microbatches="auto" if cfg.choose else cfg.microbatches,
        schedule="auto" if cfg.choose == "both" else cfg.schedule,
        scheduling=pipecut.ScheduleOptions(stages_per_rank=cfg.stages_per_rank),
        partition=pipecut.PartitionOptions(heavy_pieces=cfg.chunk_heavy, split=split))
    pipe = pipecut.compile(
        model, share(inputs, replica, replicas), devices, loss_fn=loss_fn(cfg),
        target=share(target, replica, replicas), plan=plan,
        data_parallel=None if cfg.data_parallel == "none" else cfg.data_parallel,
        measure=MEASURE,
        runtime=pipecut.RuntimeOptions(timeout=timeout, loss_reduction=cfg.reduction), **planning,
    )
    return pipe, replica, replicas


def _train(cfg: Config, pipe: Pipeline, replica: int, replicas: int, trail: Trail) -> dict[str, Any]:
    opt = torch.optim.AdamW(pipe.parameters(), **ADAMW)
    scaler = pipe.grad_scaler(init_scale=SCALE) if cfg.autocast == "fp16" else None
    out: dict[str, Any] = {"losses": [], "evals": [], "outputs": [], "grads": [], "norms": [], "weights": [],
                           "plan": pipe.plan.to_json(), "stages": pipe.stages, "replica": replica}

    def run(step: int, micro: int, evaluation: bool = False) -> Any:
        x, t, n = batch(cfg, step, micro, evaluation=evaluation)
        kw: dict[str, Any] = {"normalizer": n} if cfg.reduction == "sum" else {}
        if evaluation:  # the model's outputs too, on every rank
            kw.update(return_outputs=True, all_ranks=True)
        return pipe.step(share(x, replica, replicas), share(t, replica, replicas),
                         scaler=None if evaluation else scaler, **kw)

    for step in range(cfg.steps):
        freeze_before(cfg, step, pipe.named_parameters())
        for micro in range(cfg.accumulation):
            quiet = cfg.no_sync and micro < cfg.accumulation - 1
            trail.enter(f"step {step} call {micro}", "step", quiet, shape(cfg, step), frozen(cfg, step))
            with pipe.no_sync() if quiet else contextlib.nullcontext(), autocast(cfg):  # type: ignore[attr-defined]
                out["losses"].append(run(step, micro))
        trail.enter(f"step {step} after the calls", "update", frozen(cfg, step))
        if scaler is not None:
            scaler.unscale_(opt)
        out["grads"].append(_tensors(pipe, grads=True))
        if cfg.clip is not None:
            out["norms"].append(pipe.clip_grad_norm_(cfg.clip))
        optimizer_step(opt, scaler)
        out["weights"].append(_tensors(pipe, grads=False))
        if cfg.eval_between and step < cfg.steps - 1:
            trail.enter(f"eval after step {step}", "eval", frozen(cfg, step))
            pipe.eval()
            with torch.no_grad(), autocast(cfg):
                loss, outputs = run(step, 0, evaluation=True)
            out["evals"].append(loss)
            out["outputs"].append(outputs)
            pipe.train()
    trail.enter("end", "end")
    out["buffers"] = {n: b.detach().clone() for n, b in pipe.named_buffers()}
    out["state"] = {k: whole_copy(v) for k, v in pipe.state_dict().items()}
    out["scale"] = scaler.get_scale() if scaler is not None else None
    return out


def shape(cfg: Config, step: int) -> str:
    """The batch of optimizer step ``step``: the planned one or the drawn last one."""
    return cfg.last if step == cfg.steps - 1 else "same"


def frozen(cfg: Config, step: int) -> str:
    """Where optimizer step ``step`` stands with the drawn freeze."""
    return {1: "frozen", 2: "unfrozen again"}.get(step, "") if cfg.freeze else ""


def freeze_before(cfg: Config, step: int, named: Iterator[tuple[str, nn.Parameter]]) -> None:
    """``requires_grad_(False)`` on the drawn parameter before optimizer step 1, ``(True)`` before
    step 2 (the pipeline's and the plain model's parameters alike, by the model's names)."""
    flag = {1: False, 2: True}.get(step) if cfg.freeze else None
    if flag is not None:
        for name, p in named:
            if name == cfg.freeze:
                p.requires_grad_(flag)


def optimizer_step(opt: torch.optim.Optimizer, scaler: Any) -> None:
    """``opt.step()`` (through the GradScaler when there is one), then ``zero_grad``."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()


def _tensors(pipe: Any, grads: bool) -> dict[str, torch.Tensor]:
    """This rank's gradients (those not None) or weights by the model's names; FSDP shards
    gathered (a collective over the replicas, in the same order on each)."""
    out = {}
    for name, p in pipe.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        out[name] = whole_copy(t)
    return out
