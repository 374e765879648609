"""The per-op cost model against one GPU's own measured kernels (issue 29).

On a CUDA device: capture a model in bf16, time every node forward and backward there
(:func:`pipecut.profile.nodes.profile`, CUDA events), price the same nodes with the per-op model
of the device's family (:mod:`pipecut.profile.hardware`, the fitted residual), and compare, by
kernel kind (matrix products, attention, memory-bound ops) and in total; also the whole plain
step (forward and backward, CUDA events) and one large bf16 product's rate, which tells how much
of the family's residual is the kernel and how much is the rest of a training run.

The residual was fitted on whole multi-GPU runs (benchmarks/validation_runs.json's split), not on
this machine: a node-by-node profile on one GPU is expected to be faster than the prediction by
about what a run loses beyond its kernels (collectives, gaps, clocks under load). What this
measures is whether the *shape* of the model is right: the ratio should be similar across kinds
and models, and the dominant kind should be the same.

Without CUDA (``--cpu``): the same code on tiny models on the CPU, priced as an A100, to check the
script runs; the numbers mean nothing.

    python benchmarks/gpu_costs.py --json benchmarks/gpu_costs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from pipecut.capture import capture
from pipecut.planning.cluster.figures import family_model
from pipecut.profile.devices import Precision, count_costs, device_profile
from pipecut.profile.hardware import kernel_kind
from pipecut.profile.nodes import profile

PROFILE_OF = {"H100": "H100-SXM", "H200": "H200-SXM", "A100": "A100-80GB"}


def _profile_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "A100-80GB"
    name = torch.cuda.get_device_name(device)
    for key, prof in PROFILE_OF.items():
        if key in name:
            return prof
    raise SystemExit(f"no device profile for {name!r}")


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def _llama(tiny: bool) -> tuple[torch.nn.Module, int, int, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=256, max_position_embeddings=128)
        return LlamaForCausalLM(cfg), 2, 32, cfg.vocab_size
    # Llama-3.2-1B's layer shapes (hidden 2048, 32 heads, 8 KV heads, MLP 8192), 4 layers
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg), 2, 2048, cfg.vocab_size


def _gpt2(tiny: bool) -> tuple[torch.nn.Module, int, int, int]:
    from transformers import GPT2Config, GPT2LMHeadModel

    if tiny:
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
        return GPT2LMHeadModel(cfg), 2, 32, cfg.vocab_size
    # GPT-2 medium's layer shapes (hidden 1024, 16 heads), 4 layers
    cfg = GPT2Config(n_embd=1024, n_layer=4, n_head=16, vocab_size=50257, n_positions=1024,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg), 8, 1024, cfg.vocab_size


def _gpt2_padded(tiny: bool) -> tuple[torch.nn.Module, int, int, int]:
    """GPT-2 with its vocabulary padded to a multiple of 64 (50304, as nanoGPT pads it)."""
    from transformers import GPT2LMHeadModel

    model, batch, seq, vocab = _gpt2(tiny)
    cfg = model.config
    cfg.vocab_size = vocab if tiny else 50304
    return GPT2LMHeadModel(cfg), batch, seq, cfg.vocab_size


def _llama_odd_vocab(tiny: bool) -> tuple[torch.nn.Module, int, int, int]:
    """The Llama above with 32003 tokens (a tokenizer with three added tokens): an unaligned
    output head the misaligned-product figure was not measured on."""
    from transformers import LlamaForCausalLM

    model, batch, seq, vocab = _llama(tiny)
    cfg = model.config
    cfg.vocab_size = vocab if tiny else 32003
    return LlamaForCausalLM(cfg), batch, seq, cfg.vocab_size


MODELS = {"llama": _llama, "gpt2": _gpt2, "gpt2_vocab64": _gpt2_padded, "llama_vocab32003": _llama_odd_vocab}

_ATTENTION_KERNELS = ("flash", "fmha", "attention", "attn")
_GEMM_KERNELS = ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm80_", "cublas", "splitk")


def _kernel_kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in _ATTENTION_KERNELS):
        return "attention"
    return "gemm" if any(k in n for k in _GEMM_KERNELS) else "memory"


def _kernel_ms(model: torch.nn.Module, ids: torch.Tensor, target: torch.Tensor, steps: int = 3) -> dict[str, float]:
    """Device time of the plain step's kernels by kind (torch.profiler), per step: what the GPU
    spends, without the host's launch gaps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if ids.device.type != "cuda":
        return {}
    for _ in range(2):
        _lm_loss(model(ids), target).backward()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _lm_loss(model(ids), target).backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us:
            out[_kernel_kind(e.key)] += us / 1e3 / steps
    out["all"] = sum(out.values())
    return dict(out)


class _Logits(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, use_cache=False).logits


def _plain_step_ms(model: torch.nn.Module, ids: torch.Tensor, target: torch.Tensor, steps: int) -> float:
    cuda = ids.device.type == "cuda"
    times = []
    for _ in range(steps + 2):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        _lm_loss(model(ids), target).backward()
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    model.zero_grad(set_to_none=True)
    return statistics.median(times[2:])


def _gemm_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * 10 / (start.elapsed_time(end) * 1e-3) / 1e12


def compare(name: str, device: torch.device, tiny: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    inner, batch, seq, vocab = MODELS[name](tiny)
    model = _Logits(inner).to(device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    target = torch.randint(0, vocab, (batch, seq), device=device)
    captured = capture(model, (ids,))
    flat = captured.flatten_inputs((ids,))
    rows, work = count_costs(captured, flat, loss_fn=_lm_loss, target=target)
    prof = device_profile(_profile_name(device))
    cost_model = family_model(prof)
    assert cost_model is not None, prof.family
    predicted = {r.name: r for r in cost_model.price(rows, work)}
    measured = {r.name: r for r in profile(captured, flat, loss_fn=_lm_loss, target=target, repeats=5, warmup=2)}
    common = [n for n in predicted if n in measured]
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for n in common:
        w = work.get(n)
        kind = kernel_kind(str(predicted[n].target), w.forward_flops if w else 0).value
        for side in ("forward", "backward"):
            by_kind[kind][f"predicted_{side}_ms"] += getattr(predicted[n], f"{side}_ms")
            by_kind[kind][f"measured_{side}_ms"] += getattr(measured[n], f"{side}_ms")
    for vals in by_kind.values():
        p = vals["predicted_forward_ms"] + vals["predicted_backward_ms"]
        m = vals["measured_forward_ms"] + vals["measured_backward_ms"]
        vals["predicted_over_measured"] = p / m if m else float("nan")
    total_p = sum(v["predicted_forward_ms"] + v["predicted_backward_ms"] for v in by_kind.values())
    total_m = sum(v["measured_forward_ms"] + v["measured_backward_ms"] for v in by_kind.values())
    plain = _plain_step_ms(model, ids, target, steps=5)
    kernels = _kernel_ms(model, ids, target)
    nodes = []
    for n in common:
        w = work.get(n)
        p, m = predicted[n], measured[n]
        nodes.append({"name": n, "target": str(p.target), "shape": list(p.shape or ()),
                      "kind": kernel_kind(str(p.target), w.forward_flops if w else 0).value,
                      "predicted": [p.forward_ms, p.backward_ms], "measured": [m.forward_ms, m.backward_ms]})
    return {
        "model": name, "device_profile": prof.name, "batch": batch, "seq": seq,
        "node_count": len(rows), "compared": len(common),
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "predicted_ms": total_p, "node_sum_measured_ms": total_m, "plain_step_measured_ms": plain,
        "predicted_over_node_sum": total_p / total_m, "predicted_over_plain_step": total_p / plain,
        "plain_step_kernel_ms_by_kind": kernels, "nodes": nodes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cpu", action="store_true", help="tiny models on the CPU: checks the script runs")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_costs: no CUDA device (use --cpu to check the script on tiny models)")
        return 0
    device = torch.device("cpu" if args.cpu else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    tflops = _gemm_tflops(device)
    prof = device_profile(_profile_name(device))
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "profile": prof.name,
        "gemm_8192_bf16_tflops": tflops,
        "gemm_fraction_of_datasheet_peak": tflops * 1e12 / prof.peak_flops(Precision.BF16) if tflops else None,
        "residual_used": family_model(prof).figures["residual"],  # type: ignore[union-attr]
        "models": [],
    }
    print(f"{out['device']} (torch {out['torch']}), priced as {prof.name}; 8192^3 bf16 product: "
          f"{tflops or float('nan'):.0f} TFLOP/s; family residual {out['residual_used']:.3f}")
    print(f"{'model':16} {'kind':10} {'predicted':>9} {'nodes':>9} {'kernels':>9} {'pred/kern':>9}")
    for name in args.models:
        r = compare(name, device, tiny=args.cpu)
        out["models"].append(r)
        kernels = r["plain_step_kernel_ms_by_kind"]
        for kind, v in sorted(r["by_kind"].items()):
            p = v["predicted_forward_ms"] + v["predicted_backward_ms"]
            m = v["measured_forward_ms"] + v["measured_backward_ms"]
            k = kernels.get(kind, float("nan"))
            print(f"{name:16} {kind:10} {p:9.3f} {m:9.3f} {k:9.3f} {p / k if k else float('nan'):9.2f}")
        k = kernels.get("all", float("nan"))
        print(f"{name:16} {'all':10} {r['predicted_ms']:9.3f} {r['node_sum_measured_ms']:9.3f} {k:9.3f} "
              f"{r['predicted_ms'] / k if k else float('nan'):9.2f}   plain step {r['plain_step_measured_ms']:.3f} ms "
              f"(predicted/step {r['predicted_over_plain_step']:.2f}); {r['compared']}/{r['node_count']} nodes")
    print("predicted: the per-op model at the family's fitted residual; nodes: each node timed alone "
          "(pipecut.profile.nodes); kernels: the plain step's kernels (torch.profiler), ms per step")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
