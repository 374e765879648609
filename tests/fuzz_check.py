"""The plain model's run of a fuzzer configuration, in one process, and the comparison with
what the ranks returned.

The reference runs each replica's share microbatch by microbatch, cut as the pipeline cuts it
(``microbatch_sizes`` of the plan the ranks ran), each microbatch's loss weighted as the
pipeline weighs it (its share of the batch for a mean, 1 / normalizer for a sum, averaged over
replicas). For models without BatchNorm this is the whole batch's loss, only summed in another
order; with BatchNorm it is GPipe's semantics (statistics per microbatch, running statistics
updated once per microbatch, in order).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from pipecut.core.batching import split_by_sizes
from pipecut.core.shapes import microbatch_sizes
from pipecut.ir import Plan
from tests.fuzz_config import Config
from tests.fuzz_run import (
    ADAMW,
    SCALE,
    autocast,
    batch,
    build,
    default_dtype,
    freeze_before,
    loss_fn,
    optimizer_step,
    share,
)

TOLERANCES = {"fp32": (1e-4, 1e-5), "fp64": (1e-9, 1e-10), "bf16": (2e-2, 2e-2), "fp16": (5e-3, 5e-3),
              "bf16 weights": (2e-2, 2e-2)}
"""precision (:func:`precision`) -> (rtol, atol as a fraction of the largest reference value
of the step).

fp32: the same kernels on the same microbatches; only the order in which microbatch and
replica gradients are summed differs (a few ulps, ~1e-6 relative: tests/reference.py allows
1e-5). Ten times more here because the differences are carried through up to 3 AdamW steps
and 3 accumulated batches; a missing or doubled term is still O(1) relative.
fp64 (float64 parameters): the same argument with 2**-53 for 2**-24: measured differences
are below 1e-13 relative (benchmarks/fuzz.py --errors), so 1e-9 keeps four orders of margin
and still fails a pipeline that sends or sums anything in float32 (1e-7 relative).
bf16 (8 significant bits, 4e-3 per rounding) and fp16 (11 bits, 5e-4) autocast: the pipeline
rounds cut tensors and per-microbatch sums where the reference rounds in another order; a few
roundings accumulate, hence 5x the unit roundoff. bf16 weights: the reference runs in bf16
too, so the same bound as bf16 autocast (the measured worst was 1.3e-2 relative to a step's
largest gradient; see benchmarks/fuzz.py --errors). Weights after an update: see
:func:`weight_atol`."""


def precision(cfg: Config) -> str:
    """Which row of :data:`TOLERANCES` a configuration is compared with."""
    if cfg.autocast != "off":
        return cfg.autocast
    return {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16 weights"}[cfg.dtype]


def weight_atol(cfg: Config) -> float:
    """fp32: ADAMW's eps 1e-3 bounds an update's error by the gradient's (1e-5, see ADAMW);
    fp64 likewise (1e-10). Under autocast or in bf16 a near-zero gradient's sign may differ
    between two faithful runs, and Adam moves such a weight by up to lr either way: 2 * lr
    (each step starts from the pipeline's weights, see :func:`reference`); bf16 weights round
    that update to 8 bits of the weight (the rtol)."""
    return {"fp32": 1e-5, "fp64": 1e-10}.get(precision(cfg), 2 * ADAMW["lr"] + 1e-4)


def forced(cfg: Config, ranks: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]] | None:
    """Under autocast or with bf16 weights, the pipeline's weights after each step (merged over
    ranks), which the reference starts the next step from; None in fp32 and fp64 (the reference
    runs free).

    Why: two faithful autocast runs differ by roundings, and an optimizer step turns that into
    weight differences of up to 2 * lr (see :func:`weight_atol`); some models amplify such a
    difference at once (the BatchNorm CNN, with statistics over 2 samples, changes its
    gradients by 5% for random weight changes of 1e-4, even in fp32). Comparing every step
    from the same weights keeps each step's tolerance that of one step's roundings."""
    if precision(cfg) in ("fp32", "fp64"):
        return None
    steps = len(ranks[0]["weights"])
    return [{n: w for r in ranks for n, w in r["weights"][s].items()} for s in range(steps)]


def plain_loss(cfg: Config, model: torch.nn.Module, plan: Plan, step: int, micro: int,
               evaluation: bool = False) -> torch.Tensor:
    """The step's loss as the pipeline defines it, computed by the unsplit model."""
    inputs, target, normalizer = batch(cfg, step, micro, evaluation=evaluation)
    fn = loss_fn(cfg)
    replicas = 2 if cfg.data_parallel != "none" else 1
    total = torch.zeros((), dtype=torch.float64 if cfg.dtype == "float64" else torch.float32)
    for r in range(replicas):
        x, t = share(inputs, r, replicas), share(target, r, replicas)
        sizes = microbatch_sizes(t.shape[0], plan)
        for mb, mt, size in zip(split_by_sizes(x, sizes), split_by_sizes(t, sizes, "target"), sizes):
            out = model(**mb) if isinstance(mb, dict) else model(*mb)
            weight = size / (t.shape[0] * replicas) if cfg.reduction == "mean" else 1 / normalizer
            total = total + fn(out, mt).to(total.dtype) * weight
    return total


def plain_outputs(cfg: Config, model: torch.nn.Module, step: int) -> list[Any]:
    """The model's outputs on each replica's share of the eval batch after ``step``."""
    inputs, _, _ = batch(cfg, step, 0, evaluation=True)
    replicas = 2 if cfg.data_parallel != "none" else 1
    out = []
    for r in range(replicas):
        x = share(inputs, r, replicas)
        out.append(model(**x) if isinstance(x, dict) else model(*x))
    return out


def reference(cfg: Config, plan: Plan, start: list[dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """What :func:`tests.fuzz_run.run_config` returns, from the plain model; ``start``: the
    weights each step after the first starts from (see :func:`forced`)."""
    with default_dtype(cfg):
        return _reference(cfg, plan, start)


def _reference(cfg: Config, plan: Plan, start: list[dict[str, torch.Tensor]] | None) -> dict[str, Any]:
    model = build(cfg)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if cfg.autocast == "fp16" else None
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {"losses": [], "evals": [], "outputs": [], "grads": [], "norms": [], "weights": []}
    for step in range(cfg.steps):
        freeze_before(cfg, step, model.named_parameters())
        for micro in range(cfg.accumulation):
            with autocast(cfg):
                loss = plain_loss(cfg, model, plan, step, micro)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            out["losses"].append(loss.detach())
        if scaler is not None:
            scaler.unscale_(opt)
        out["grads"].append({names[id(p)]: p.grad.clone() for p in model.parameters() if p.grad is not None})
        if cfg.clip is not None:
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip))
        optimizer_step(opt, scaler)
        out["weights"].append({names[id(p)]: p.detach().clone() for p in model.parameters()})
        if start is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(start[step][names[id(p)]])
        if cfg.eval_between and step < cfg.steps - 1:
            model.eval()
            with torch.no_grad(), autocast(cfg):
                out["evals"].append(plain_loss(cfg, model, plan, step, 0, evaluation=True))
                out["outputs"].append(plain_outputs(cfg, model, step))
            model.train()
    out["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
    out["state"] = model.state_dict()
    out["scale"] = scaler.get_scale() if scaler is not None else None
    return out


class Mismatch(AssertionError):
    """The pipeline's numbers differ from the plain model's."""


def compare(cfg: Config, ref: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Raise :class:`Mismatch` naming the first quantity (step, rank, tensor) that differs, in
    the order the loop computes them, so that the first one reported is the earliest cause.
    Returns the worst errors seen (what the tolerances are measured by): ``loss`` relative to
    the loss, ``grad`` relative to the step's largest gradient, ``weight`` absolute."""
    rtol, frac = TOLERANCES[precision(cfg)]
    worst: dict[str, float] = {}

    def close(got: Any, want: Any, what: str, atol: float, kind: str = "", unit: float = 1.0) -> None:
        got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
        if kind and want.numel() and got.shape == want.shape:
            worst[kind] = max(worst.get(kind, 0.0), (got - want).abs().max().item() / (unit or 1.0))
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise Mismatch(f"{what}: {e}") from None

    for r, got in enumerate(ranks):
        _same_length(got, ref, r)
    for step in range(cfg.steps):
        calls = range(step * cfg.accumulation, (step + 1) * cfg.accumulation)
        want_grads = ref["grads"][step]
        atol = frac * _scale(want_grads.values())
        for r, got in enumerate(ranks):
            for i in calls:
                want = ref["losses"][i]
                close(got["losses"][i], want, f"step {step}: rank {r} loss of pipe.step call {i}",
                      frac * abs(want.item()), "loss", abs(want.item()))
            for name, g in got["grads"][step].items():
                if name not in want_grads:
                    raise Mismatch(f"step {step}: rank {r}: {name} has a gradient, the plain model none")
                close(g, want_grads[name], f"step {step}: rank {r} grad {name}", atol, "grad", atol / frac)
        held = set().union(*(got["grads"][step] for got in ranks))
        if set(want_grads) - held:
            raise Mismatch(f"step {step}: gradients on no rank: {sorted(set(want_grads) - held)[:4]}")
        for r, got in enumerate(ranks):
            if cfg.clip is not None:
                want = ref["norms"][step]
                close(got["norms"][step], want, f"step {step}: rank {r} clip_grad_norm_", frac * want.item())
            for name, w in got["weights"][step].items():
                close(w, ref["weights"][step][name], f"step {step}: rank {r} weight {name} after opt.step",
                      weight_atol(cfg), "weight")
            if step < len(ref["evals"]):
                want = ref["evals"][step]
                close(got["evals"][step], want, f"after step {step}: rank {r} eval loss",
                      frac * abs(want.item()))
                outputs = tree_leaves(got["outputs"][step])
                wanted = tree_leaves(ref["outputs"][step][got["replica"]])
                if len(outputs) != len(wanted):
                    raise Mismatch(f"after step {step}: rank {r} eval outputs: {len(outputs)} tensors, "
                                   f"the plain model {len(wanted)}")
                for i, (a, b) in enumerate(zip(outputs, wanted)):
                    close(a, b, f"after step {step}: rank {r} eval output {i}", frac * _scale(wanted))
    keys = set().union(*(got["state"] for got in ranks))
    if keys != set(ref["state"]):
        raise Mismatch(f"end: merged state_dict keys differ from the plain model's: missing "
                       f"{sorted(set(ref['state']) - keys)[:4]}, extra {sorted(keys - set(ref['state']))[:4]}")
    weighted = set().union(*(got["weights"][-1] for got in ranks))
    if set(ref["weights"][-1]) - weighted:
        raise Mismatch(f"weights on no rank: {sorted(set(ref['weights'][-1]) - weighted)[:4]}")
    for r, got in enumerate(ranks):
        for name, b in got["buffers"].items():
            if name in ref["buffers"]:
                want = ref["buffers"][name]
                close(b, want, f"end: rank {r} buffer {name}", frac * _scale([want]) if want.is_floating_point() else 0)
        for key, value in got["state"].items():
            want = ref["state"].get(key)
            if want is None:
                raise Mismatch(f"end: rank {r} state_dict has {key}, the plain model's has not")
            close(value, want, f"end: rank {r} state_dict {key}", weight_atol(cfg) if want.is_floating_point() else 0)
        if got["scale"] != ref["scale"]:
            raise Mismatch(f"end: rank {r}: GradScaler scale {got['scale']}, the plain model's {ref['scale']}")
    return worst


def _scale(tensors: Any) -> float:
    """The largest magnitude in ``tensors``: the unit of a normwise absolute tolerance."""
    return max((t.abs().max().item() for t in tensors if t.numel()), default=1.0)


def _same_length(got: dict[str, Any], ref: dict[str, Any], rank: int) -> None:
    for key in ("losses", "evals", "outputs", "grads", "norms", "weights"):
        if len(got[key]) != len(ref[key]):
            raise Mismatch(f"rank {rank}: {len(got[key])} {key}, the plain model {len(ref[key])}")


def check(cfg: Config, ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Compare what the ranks returned with the plain model's run (raises :class:`Mismatch`);
    the worst errors (see :func:`compare`)."""
    return compare(cfg, reference(cfg, Plan.from_json(ranks[0]["plan"]), forced(cfg, ranks)), ranks)
