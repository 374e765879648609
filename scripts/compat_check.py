"""Does pipecut run on the torch, transformers and Python of this venv? ``make compat``.

``make compat`` runs this script in two venvs, the oldest and the newest releases that
pyproject.toml declares (README, "Versions"), so that the declared range is the tested range.
It prints the versions, one line per check (``ok`` or ``FAILED`` with the reason), then
``compat: N passed, M failed``; exit status 1 if any check failed. Tracebacks of the failures go
to ``build/compat-<venv>.log``.

The checks, each against the plain model in this process:

- ``1f1b <model>``: a transformers Llama, GPT-2 and ViT built with transformers' default
  attention are captured and planned in one process (the step where new model code or a new
  torch.export shows first: a failure names the versions, the model and the line it broke in),
  then each plan runs one 1F1B step on 2 ranks; the loss and every gradient must match.
- ``tp2 x pp2 llama``: the Llama on a ("pp", "tp") mesh of 2 x 2 (DTensor stages), one step.
- ``compiled stages``: ``RuntimeOptions(compile_stages=True)`` (inductor) on a tiny MLP.
- ``zero-bubble``: the zero-bubble schedule (backward split into input and weight gradients).
- ``checkpoint``: save after an optimizer step, load into a fresh pipeline and into the plain
  model; every tensor and the optimizer state come back bit for bit.

The last three use the repository's own GPT and MLP (no transformers code): they check torch
alone. Scenarios share forks (forking is cheap, compiling is not); an error in one scenario is
caught where it happens, and the scenarios after it run in a fresh fork (a failed step closes
the process group), so one failure does not hide the others. Plans use counted costs
(``tests.reference.COUNTED``): the split is the same on every run whatever the machine's load.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Inductor compiles in the calling process: no worker pool forked from a forked rank.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pipecut  # noqa: E402
from examples import gpt, mlp, zoo  # noqa: E402
from pipecut.core.graph import canonical_names  # noqa: E402
from pipecut.runtime.state import checkpoint  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.reference import COUNTED, assert_parity, reference  # noqa: E402

# float32 throughout. The pipeline runs the captured ATen graph (and inductor's kernels for
# compiled stages) while the reference runs the eager modules on the whole batch, so the same
# math is grouped differently: fused or decomposed softmax, layer norm and attention, gradients
# summed per microbatch, a split product's partial sums all-reduced over the tensor group. The
# repository's parity tests measure at most ~1e-6 relative to a tensor's largest entry
# (tests/multiprocess/test_zoo.py, test_tensor_parallel.py, test_execution_compiled.py).
# atol=1e-5, rtol=1e-4 (as the first two) leaves an order of margin and stays far below any real
# error: a missing or doubled microbatch, a lost gradient part or a wrong shard is off by >1e-3.
ATOL, RTOL = 1e-5, 1e-4
M = 4  # microbatches
BATCH = 8
TIMEOUT = 60.0  # seconds a rank waits for a peer (RuntimeOptions.timeout)


# --- models ---------------------------------------------------------------------------------------
# transformers models with its default attention (no attn_implementation: whatever the release
# picks, SDPA today), at examples/zoo.py's small sizes, every dropout at 0.
def llama(batch_size: int = BATCH, seed: int = 0) -> zoo.Built:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=zoo.VOCAB, hidden_size=zoo.HIDDEN, intermediate_size=2 * zoo.HIDDEN,
                         num_hidden_layers=zoo.LAYERS, num_attention_heads=zoo.HEADS, num_key_value_heads=2,
                         max_position_embeddings=zoo.SEQ, use_cache=False, attention_dropout=0.0)
    ids, target = zoo._tokens(batch_size)
    return LlamaForCausalLM(config), {"input_ids": ids}, zoo.logits_ce, target


def gpt2(batch_size: int = BATCH, seed: int = 0) -> zoo.Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=zoo.VOCAB, n_positions=zoo.SEQ, n_embd=zoo.HIDDEN, n_layer=zoo.LAYERS,
                        n_head=zoo.HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        summary_first_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    ids, target = zoo._tokens(batch_size)
    return GPT2LMHeadModel(config), {"input_ids": ids}, zoo.logits_ce, target


def vit(batch_size: int = BATCH, seed: int = 0) -> zoo.Built:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=zoo.HIDDEN, num_hidden_layers=zoo.LAYERS, num_attention_heads=zoo.HEADS,
                       intermediate_size=2 * zoo.HIDDEN, image_size=zoo.IMAGE, patch_size=8,
                       num_labels=zoo.CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    x, y = zoo._images(batch_size)
    return ViTForImageClassification(config), {"pixel_values": x}, zoo.logits_ce, y


def small_gpt(seed: int = 0) -> Any:
    """The repository's GPT (tied embeddings, captured by symbolic_trace): torch alone."""
    return gpt.build(batch_size=BATCH, seed=seed, vocab=64, dim=32, heads=2, layers=2, seq=16)


def tiny_mlp() -> Any:
    return mlp.build(batch_size=BATCH, width=32, depth=4)


HF: dict[str, Callable[..., zoo.Built]] = {"llama": llama, "gpt2": gpt2, "vit": vit}


# --- naming a failure -----------------------------------------------------------------------------
def versions() -> dict[str, str]:
    try:
        import transformers

        hf = transformers.__version__
    except Exception as e:  # the checks of transformers models then fail one by one, saying why
        hf = f"? (import failed: {type(e).__name__}: {e})"
    return {"torch": torch.__version__, "transformers": hf, "python": ".".join(map(str, sys.version_info[:3]))}


def _origin(text: str) -> str:
    """Where a traceback broke: its deepest frame inside transformers, torch or pipecut, after
    the deepest transformers frame above it (the model code's line) where that is another."""
    frames = []
    for path, line in re.findall(r'File "([^"]+)", line (\d+)', text):
        for package, shown in (("transformers", "transformers"), ("torch", "torch"), ("compiler", "pipecut"),
                               ("passes", "pipecut/passes"), ("runtime", "pipecut/runtime")):
            if f"/{package}/" in path:
                frames.append(f"{shown}/{path.rsplit(f'/{package}/', 1)[1]}:{line}")
                break
    if not frames:
        return "?"
    model_code = [f for f in frames if f.startswith("transformers/")]
    if model_code and model_code[-1] != frames[-1]:
        return f"{model_code[-1]} -> {frames[-1]}"
    return frames[-1]


_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Expired|Interrupt)\b")


def _last_error(text: str) -> str:
    """The last 'Type: message' line of a traceback text (a rank's, or ours); of a CaptureError,
    the line of the torch.export attempt (the one transformers models take)."""
    lines = text.strip().splitlines()
    raised = [i for i, ln in enumerate(lines) if _RAISED.match(ln)]
    if not raised:
        return " ".join(text.split())[-300:]
    line = lines[raised[-1]]
    if "CaptureError" in line:
        line = next((ln.strip() for ln in lines[raised[-1]:] if ln.strip().startswith("torch.export")), line)
    return line[:300]


def _export_alone(build: Callable[[], zoo.Built]) -> str:
    """torch.export of the model without pipecut: its traceback, or "" where it works. Names
    where the model code and this torch part (pipecut's CaptureError keeps only the message)."""
    model, inputs, _, _ = build()
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
    try:
        torch.export.export(model, args, kwargs, strict=False)
    except Exception:
        return traceback.format_exc()
    return ""


def drift(build: Callable[[], zoo.Built], text: str) -> str:
    """A capture failure named by versions and model: the model code of transformers' major
    release against this torch, where it broke, then the error."""
    v = versions()
    model = type(build()[0]).__name__
    code = f"{model} (transformers {v['transformers'].split('.')[0]}.x model code)"
    under = f"under torch {v['torch']}, transformers {v['transformers']}"
    alone = _export_alone(build)
    if alone:
        return f"torch.export of {code} fails {under}, in {_origin(alone)}: {_last_error(alone)}"
    return (f"pipecut could not capture {code} {under} (torch.export alone works), "
            f"in {_origin(text)}: {_last_error(text)}")


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"ok": fn()}`` or ``{"error": traceback}``: one scenario's failure stays its own."""
    try:
        return {"ok": fn()}
    except Exception:
        return {"error": traceback.format_exc()}


# --- on the ranks ---------------------------------------------------------------------------------
def _result(model: torch.nn.Module, pipe: Any, loss: torch.Tensor) -> dict[str, Any]:
    """The loss and this rank's gradients under canonical names, a DTensor's gathered whole
    (collective over its tensor group: every rank walks its parameters in the same order)."""
    names = canonical_names(model)
    alias = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    grads = {alias[n]: zoo.whole_copy(p.grad) for n, p in pipe.named_parameters() if p.grad is not None}
    return {"loss": loss.detach().clone(), "grads": grads}


def _step(build: Callable[[], Any], devices: Any, **kwargs: Any) -> dict[str, Any]:
    model, inputs, loss_fn, target = build()
    kwargs.setdefault("runtime", pipecut.RuntimeOptions(timeout=TIMEOUT))
    if "plan" not in kwargs:
        kwargs.update(microbatches=M, measure=COUNTED, schedule=kwargs.get("schedule", "1f1b"))
    pipe = pipecut.compile(model, inputs, devices, loss_fn=loss_fn, target=target, **kwargs)
    return _result(model, pipe, pipe.step(inputs, target))


def _round_trip(directory: str) -> dict[str, Any]:
    """One step and an AdamW step, save; a fresh pipeline of a model with other weights loads."""
    model, inputs, loss_fn, target = small_gpt()
    pipe = pipecut.compile(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=M, schedule="1f1b",
                           measure=COUNTED, runtime=pipecut.RuntimeOptions(timeout=TIMEOUT))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.step(inputs, target)
    opt.step()
    checkpoint.save(pipe, directory, opt, step=1)
    names = canonical_names(model)
    saved = {n: t.detach().clone() for n, t in checkpoint.stage_tensors(pipe).items()}
    saved_avg = {names[id(p)]: s["exp_avg"].clone() for p, s in opt.state.items()}
    canonical = {names[id(p)]: p.detach().clone() for p in pipe.parameters()}

    fresh, inputs, loss_fn, target = small_gpt(seed=1)  # other weights: each value must come from the file
    again = pipecut.compile(fresh, inputs, 2, loss_fn=loss_fn, target=target, plan=pipe.plan,
                            runtime=pipecut.RuntimeOptions(timeout=TIMEOUT))
    opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    loaded = checkpoint.load(again, directory, opt)
    fresh_names = canonical_names(fresh)
    return {"step": loaded.step, "saved": saved, "saved_avg": saved_avg, "canonical": canonical,
            "loaded": {n: t.detach().clone() for n, t in checkpoint.stage_tensors(again).items()},
            "loaded_avg": {fresh_names[id(p)]: s["exp_avg"].clone() for p, s in opt.state.items()}}


def _plans(rank: int, world: int) -> dict[str, dict[str, str]]:
    """Capture and plan each transformers model: its plan, or the traceback and the drift line."""
    out = {}
    for name, build in HF.items():
        model, inputs, loss_fn, target = build()
        try:
            out[name] = {"ok": pipecut.plan(model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=M,
                                            schedule="1f1b", measure=COUNTED).to_json()}
        except Exception:
            text = traceback.format_exc()
            out[name] = {"error": text, "reason": drift(build, text)}
    return out


def _tp_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))


Scenario = Callable[[int, dict[str, Any]], Any]
"""``fn(world, context)`` on every rank of a fork; context: the plans and a shared directory."""

SCENARIOS: dict[str, Scenario] = {
    **{name: (lambda world, ctx, name=name: _step(HF[name], world, plan=ctx["plans"][name])) for name in HF},
    "zero-bubble": lambda world, ctx: _step(small_gpt, world, schedule="zero-bubble"),
    "checkpoint": lambda world, ctx: _round_trip(f"{ctx['directory']}/ckpt"),
    "compiled": lambda world, ctx: _step(  # the first compile of a stage may outlast TIMEOUT
        tiny_mlp, world, runtime=pipecut.RuntimeOptions(timeout=300, compile_stages=True)),
    "tp": lambda world, ctx: _step(llama, _tp_mesh()),
}


def _scenarios(rank: int, world: int, names: list[str], ctx: dict[str, Any]) -> dict[str, Any]:
    """Run ``names`` in order; stop at the first that fails (a failed step closes the process
    group, so the ones after it run in a fresh fork: see :func:`run_scenarios`)."""
    out = {}
    for name in names:
        out[name] = _attempt(lambda name=name: SCENARIOS[name](world, ctx))
        if "error" in out[name]:
            break
    return out


# --- the checks -----------------------------------------------------------------------------------
class Failed(Exception):
    """A check's failure, with the line to print (the traceback goes to the log)."""

    def __init__(self, reason: str, details: str = "") -> None:
        super().__init__(reason)
        self.details = details


def _ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float) -> list[Any] | str:
    """Each rank's result, or the text of why the fork as a whole failed (a hung or dead rank)."""
    try:
        return run_ranks(fn, world, *args, timeout=timeout, collective_timeout=timeout)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def run_scenarios(names: list[str], world: int, ctx: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Each scenario's results on every rank (or why its fork did not finish), as many in one
    fork as pass: a fork starts again after the first scenario that fails on any rank."""
    results: dict[str, Any] = {}
    pending = list(names)
    while pending:
        ranks = _ranks(_scenarios, world, pending, ctx, timeout=timeout)
        if isinstance(ranks, str):
            results.update(dict.fromkeys(pending, ranks))
            break
        done = 0
        for name in pending:
            if not all(name in r for r in ranks):
                break
            results[name] = [r[name] for r in ranks]
            done += 1
            if any("error" in x for x in results[name]):
                break
        if done == 0:  # every rank runs the first: a guard against looping
            results[pending[0]], done = "RuntimeError: not run on every rank", 1
        pending = pending[done:]
    return results


def _unpack(ranks: list[dict[str, Any]] | str, what: str, build: Callable[[], zoo.Built] | None = None) -> list[Any]:
    """A scenario's result on every rank, or :class:`Failed` naming the first error."""
    if isinstance(ranks, str):
        raise Failed(f"{what}: {ranks.splitlines()[0][:200]}; last error: {_last_error(ranks)}", ranks)
    errors = [(rank, r["error"]) for rank, r in enumerate(ranks) if "error" in r]
    if errors:
        text = "\n".join(f"--- rank {rank} ---\n{e}" for rank, e in errors)
        first = errors[0][1]
        if build is not None and ("/compiler/capture/" in first or "CaptureError" in first):
            raise Failed(drift(build, first), text)
        raise Failed(f"{what}, rank {errors[0][0]}, in {_origin(first)}: {_last_error(first)}", text)
    return [r["ok"] for r in ranks]


def _parity(build: Callable[[], Any], results: list[dict[str, Any]]) -> str:
    loss, grads = reference(build, M, per_microbatch=False)
    assert_parity(loss, grads, results, rtol=RTOL, atol=ATOL)
    return f"loss {float(loss):.4f} and {len(grads)} gradients match"


def _check_round_trip(results: list[dict[str, Any]]) -> str:
    for rank, r in enumerate(results):
        assert r["step"] == 1, f"rank {rank}: step {r['step']} loaded, 1 saved"
        assert r["saved"].keys() == r["loaded"].keys(), f"rank {rank}: {sorted(r['saved'])} vs {sorted(r['loaded'])}"
        for name, t in r["saved"].items():
            assert torch.equal(t, r["loaded"][name]), f"rank {rank}: {name} differs after loading"
        assert r["saved_avg"].keys() == r["loaded_avg"].keys(), f"rank {rank}: optimizer state lost"
        for name, t in r["saved_avg"].items():
            assert torch.equal(t, r["loaded_avg"][name]), f"rank {rank}: exp_avg of {name} differs"
    return "parameters and optimizer state equal after loading"


def _check_plain(results: list[dict[str, Any]], directory: str) -> str:
    plain = small_gpt(seed=2)[0]
    checkpoint.load_into_model(plain, f"{directory}/ckpt")
    merged = {n: t for r in results for n, t in r["canonical"].items()}
    names = canonical_names(plain)
    for p in plain.parameters():
        assert torch.equal(p.detach(), merged[names[id(p)]]), f"plain model: {names[id(p)]} differs"
    return "and in the plain model"


class Report:
    """Prints each check's line as it is decided; keeps the tracebacks for the log."""

    def __init__(self) -> None:
        self.passed = self.failed = 0
        self.details: list[str] = []

    def check(self, what: str, fn: Callable[[], str]) -> None:
        try:
            line = f"ok      {what}: {fn()}"
            self.passed += 1
        except Failed as e:
            line = f"FAILED  {what}: {e}"
            self.details.append(f"=== {what}\n{e}\n{e.details}")
            self.failed += 1
        except Exception as e:  # a parity assertion, or the reference itself
            line = f"FAILED  {what}: {type(e).__name__}: {' '.join(str(e).split())[:400]}"
            self.details.append(f"=== {what}\n{traceback.format_exc()}")
            self.failed += 1
        print(line, flush=True)


def main(directory: str) -> int:
    v = versions()
    print(f"torch {v['torch']}, transformers {v['transformers']}, python {v['python']} ({sys.prefix})", flush=True)
    # Every fork first, every comparison after. Planning runs a backward on fake tensors; on torch
    # 2.14.1 (a CUDA build) that marks autograd's device threads in the process, and a rank forked
    # from it fails its first backward ("Unable to handle autograd's threading in combination with
    # fork-based multiprocessing"). So the plans are made in a forked process of their own.
    planned = _ranks(_plans, 1, timeout=300)
    plans = {} if isinstance(planned, str) else planned[0]
    ctx = {"plans": {n: p["ok"] for n, p in plans.items() if "ok" in p}, "directory": directory}
    two = [*ctx["plans"], "zero-bubble", "checkpoint", "compiled"]
    results = {**run_scenarios(two, 2, ctx, timeout=600), **run_scenarios(["tp"], 4, ctx, timeout=300)}

    report = Report()
    for name, build in HF.items():
        def hf(name: str = name, build: Callable[[], zoo.Built] = build) -> str:
            if isinstance(planned, str):
                raise Failed(f"planning did not finish: {_last_error(planned)}", planned)
            if "error" in plans[name]:
                raise Failed(plans[name]["reason"], plans[name]["error"])
            return _parity(build, _unpack(results[name], f"1f1b {name}", build))
        report.check(f"1f1b {name} (capture, plan, 2 ranks, default attention)", hf)
    report.check("zero-bubble (2 ranks)", lambda: _parity(small_gpt, _unpack(results["zero-bubble"], "zero-bubble")))

    def round_trip() -> str:
        ranks = _unpack(results["checkpoint"], "checkpoint")
        return f"{_check_round_trip(ranks)}, {_check_plain(ranks, directory)}"
    report.check("checkpoint (save, load into a fresh pipeline)", round_trip)
    report.check("compiled stages (2 ranks, inductor)",
                 lambda: _parity(tiny_mlp, _unpack(results["compiled"], "compiled stages")))
    report.check("tp2 x pp2 llama (4 ranks, default attention)",
                 lambda: _parity(llama, _unpack(results["tp"], "tp2 x pp2 llama", llama)))

    if report.details:
        log = ROOT / "build" / f"compat-{Path(sys.prefix).name.lstrip('.') or 'venv'}.log"
        log.parent.mkdir(exist_ok=True)
        log.write_text(f"{v}\n\n" + "\n\n".join(report.details))
        print(f"tracebacks: {log.relative_to(ROOT)}")
    print(f"compat: {report.passed} passed, {report.failed} failed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="compat-") as tmp:
        # A cache of this run: a compile read back from an old cache would skip code generation.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", f"{tmp}/inductor")
        code = main(tmp)
    print(f"({time.monotonic() - start:.0f} s)", file=sys.stderr)
    sys.exit(code)
