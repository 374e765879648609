"""The largest model this machine holds: a TinyLlama-1.1B-shaped Llama trained at K = 4.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tinyllama.py [--dir /tmp/tinyllama]
        [--steps 3] [--batch 4] [--seq 64] [--out benchmarks/tinyllama.json]

1. A Llama of TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads, 4 KV heads,
   intermediate 5632, vocabulary 32000; about 1.1 B parameters, 4.4 GB in fp32) is made with
   random weights and written with ``save_pretrained`` (once: an existing ``--dir`` is reused).
2. A plain run in one process (its own forked process, so its memory is its own):
   ``from_pretrained`` of that directory, ``--steps`` AdamW steps on fixed batches.
3. pipecut: four forked ranks on gloo, the model built on meta, each rank loading only its
   stage from the directory (``weights=``), 1F1B over 4 microbatches, the same AdamW steps.

It prints each step's loss on both sides (they must agree within fp32 reordering; the
benchmark fails otherwise), the step times, and each rank's peak RSS beside what the plan
predicts for its stage (parameters + gradients + AdamW state + activations). Not a test: it
takes minutes and most of this machine's 24 GB.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from tests.harness import run_ranks

SHAPE = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
             intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
             tie_word_embeddings=False, use_cache=False, attention_dropout=0.0)
K, MICROBATCHES, LR = 4, 4, 1e-4


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPE)


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batches(steps: int, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        t = torch.randint(0, SHAPE["vocab_size"], (batch, seq + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def save(directory: Path) -> None:
    from transformers import LlamaForCausalLM

    if (directory / "config.json").exists():
        return
    torch.manual_seed(0)
    LlamaForCausalLM(config()).save_pretrained(directory)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _plain(rank: int, world: int, directory: str, data: list[Any]) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, times = [], []
    for x, y in data:
        start = time.perf_counter()
        loss = loss_fn(model(input_ids=x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"losses": losses, "times_s": times, "peak_rss": _rss_bytes()}


def _pipelined(rank: int, world: int, directory: str, data: list[Any]) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config())
    x, y = data[0]
    pipe = pipecut.compile(
        model, {"input_ids": x}, world, loss_fn=loss_fn, target=y,
        microbatches=MICROBATCHES, schedule="1f1b", weights=directory,
        measure=pipecut.MeasureOptions(calibration_steps=0),
        runtime=pipecut.RuntimeOptions(timeout=1800, lean_host_memory=True),
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, times = [], []
    for x, y in data:
        start = time.perf_counter()
        loss = pipe.step({"input_ids": x}, y)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    stage = pipe.plan.stages[pipe.stage]
    return {"losses": losses, "times_s": times, "peak_rss": _rss_bytes(),
            "predicted_bytes": stage.peak_memory_bytes, "param_bytes": stage.param_bytes,
            "predicted_step_ms": pipe.plan.predicted.step_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/tinyllama")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/tinyllama.json")
    args = parser.parse_args()
    directory = Path(args.dir)
    save(directory)
    data = batches(args.steps, args.batch, args.seq)
    plain = run_ranks(_plain, 1, str(directory), data, timeout=7200, collective_timeout=3600)[0]
    ranks = run_ranks(_pipelined, K, str(directory), data, timeout=7200, collective_timeout=3600)
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(plain["losses"]),
                               rtol=1e-4, atol=1e-5)  # fp32; AdamW amplifies reordering slightly
    def fmt(values: list[float], digits: int) -> str:
        return ", ".join(f"{v:.{digits}f}" for v in values)

    print(f"losses   plain [{fmt(plain['losses'], 5)}]  pipecut [{fmt(ranks[0]['losses'], 5)}]")
    print(f"step s   plain [{fmt(plain['times_s'], 1)}]  pipecut [{fmt(ranks[0]['times_s'], 1)}]  "
          f"(predicted {ranks[0]['predicted_step_ms'] / 1e3:.1f})")
    print(f"{'rank':<6}{'peak RSS GiB':>14}{'plan GiB':>10}{'params GiB':>12}")
    for r, res in enumerate(ranks):
        print(f"{r:<6}{res['peak_rss'] / 2**30:>14.2f}{res['predicted_bytes'] / 2**30:>10.2f}"
              f"{res['param_bytes'] / 2**30:>12.2f}")
    print(f"plain one process: peak RSS {plain['peak_rss'] / 2**30:.2f} GiB")
    Path(args.out).write_text(json.dumps({"plain": plain, "ranks": ranks, "args": vars(args)},
                                         indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
