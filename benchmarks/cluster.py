"""Published training runs beside pipecut's cluster prediction.

    .venv/bin/python benchmarks/cluster.py [--rows standin|estimate] [--layers N] [--seq T]
                                            [--out benchmarks/cluster.json]

Each run of :data:`published.RUNS` (torchtitan's FSDP Llama runs on H100 and A100) is predicted
by :func:`pipecut.clusters.predict_run` with one compute efficiency per device family
(:data:`pipecut.clusters.FAMILY_EFFICIENCY`, each fitted on the run marked "fit"); the GPipe
row is the predicted throughput ratio of 8 stages over 2. ``--rows estimate`` prices the model
with :func:`pipecut.estimate_costs` on a meta Llama (needs the fast meta estimator: today it
runs each node on the CPU); the default is the stand-in table of :func:`published.llama_rows`.
``--layers``/``--seq`` shrink the model for a quick look (the published figures then do not
apply).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import published

__all__ = ["main"]


def _estimated(run: published.PublishedRun, dims: published.LlamaDims, seq: int):  # pragma: no cover
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipecut import estimate_costs
    from pipecut.clusters import family_efficiency, parse_cluster
    from pipecut.devices import device_profile

    cluster = parse_cluster(run.cluster)
    cfg = LlamaConfig(hidden_size=dims.hidden, intermediate_size=dims.ffn, num_hidden_layers=dims.layers,
                      num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
                      vocab_size=dims.vocab, max_position_embeddings=seq, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(run.local_batch * cluster.gpus, seq, dtype=torch.long, device="meta")
    eff, _ = family_efficiency(device_profile(cluster.device))
    return estimate_costs(model, {"input_ids": ids}, cluster.device, precision="bf16",
                          compute_efficiency=eff)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", choices=("standin", "estimate"), default="standin")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).with_name("cluster.json")))
    args = ap.parse_args(argv)
    out = []
    print(f"{'run':20} {'D×K':>7} {'tok/s/GPU':>10} {'published':>9} {'diff':>7} "
          f"{'GiB':>6} {'published':>9} {'diff':>7} {'MFU':>6} {'s':>5}")
    for run in published.RUNS:
        dims = published.LLAMA[run.model]
        if args.layers:
            dims = dataclasses.replace(dims, layers=args.layers)
        if args.seq:
            run = dataclasses.replace(run, seq=args.seq)
        t = time.perf_counter()
        rows = _estimated(run, dims, run.seq) if args.rows == "estimate" else None
        if rows is None and args.layers:
            from pipecut.clusters import family_efficiency, parse_cluster
            from pipecut.devices import device_profile

            c = parse_cluster(run.cluster)
            rows = published.llama_rows(dims, samples=run.local_batch * c.gpus, seq=run.seq, device=c.device,
                                        compute_efficiency=family_efficiency(device_profile(c.device))[0])
        p = published.predict(run, rows=rows)
        took = time.perf_counter() - t
        tput = p.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu - 1
        mem = "" if run.memory_gib is None else f"{p.memory_gib / run.memory_gib - 1:+.1%}"
        print(f"{run.name + (' (fit)' if run.fitted else ''):20} {p.replicas}×{p.stages:<4} "
              f"{p.tokens_per_s_per_gpu:>10.0f} {run.tokens_per_s_per_gpu:>9.0f} {tput:>+7.1%} "
              f"{p.memory_gib:>6.1f} {run.memory_gib or '-':>9} {mem:>7} {p.mfu:>6.1%} {took:>5.1f}")
        out.append({"run": dataclasses.asdict(run), "predicted": dataclasses.asdict(p), "seconds": took})
    speedup = published.gpipe_speedup()
    print(f"{'GPipe 48 layers':20} K 2->8 speedup {speedup:.2f} (published {published.GPIPE_SPEEDUP[0]}, "
          f"{speedup / published.GPIPE_SPEEDUP[0] - 1:+.1%})")
    out.append({"run": "gpipe", "predicted_speedup": speedup, "published": published.GPIPE_SPEEDUP})
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
