"""Issue 42's composition matrix: schedule x replicas x T x recompute x stages, at parity or refused.

Every cell is a zoo-matrix cell (``benchmarks/zoo_matrix.py``: its own forked gloo ranks, one
training step, loss, gradients and buffers against the plain model on the whole batch), on the
GPT example (``examples/gpt.py``, 4 blocks) and the transformers Llama of the zoo
(``examples/architectures.py``, transformers' default attention):

- schedule: GPipe, 1F1B and zero-bubble (batch 4 per pipeline in 2 microbatches), interleaved
  1F1B and ZBV (2 stages per rank, batch 4 in 4);
- replicas: none, DDP or FSDP2 (two replicas, each on its half of a batch of 8: D x K ranks);
- T: 1 or 2 (each stage split over 2 ranks, DTensor; sequence parallelism off);
- recompute: none, or selective (each stage recomputes its first block);
- stages: eager, or compiled (``compile_stages=True``: whole, or apart from the weight ops under
  zero-bubble and ZBV and wherever T = 2).

K = 2, so a cell runs on D x 2 x T ranks (up to 8 on this 2-core machine). Plans are the fixed
cost table's (``examples.pinned``), the same on every run. A cell reads as in the zoo matrix
(``pass``, ``FAIL``, ``refused(Class)``, ``error(Class)``, ``timeout``); every cell is expected
to pass (compiled stages with T = 2, refused until 2026-12-07, among them).

    .venv/bin/python benchmarks/composition_matrix.py                       # all 240 cells (hours)
    .venv/bin/python benchmarks/composition_matrix.py --models gpt --replicas none ddp --tensor 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.zoo_matrix import Column, sweep, table  # noqa: E402
from examples import gpt  # noqa: E402
from examples.architectures import ARCHITECTURES  # noqa: E402
from pipecut import ScheduleKind  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
REPLICAS = ("none", "ddp", "fsdp")
RECOMPUTE = ("none", "selective")
STAGES = ("eager", "compiled")


def gpt_example(batch_size: int = 8, seed: int = 0) -> Any:
    """The GPT example at a size whose four blocks fill 4 stages (ZBV, interleaved)."""
    return gpt.build(batch_size=batch_size, seed=seed, vocab=64, dim=32, heads=2, layers=4, seq=16)


MODELS = {"gpt": gpt_example, "llama": ARCHITECTURES["llama"]}


def column(schedule: str, replicas: str, tensor: int, recompute: str, stages: str) -> Column:
    kind = ScheduleKind(schedule)
    microbatches = 4 if kind in (ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.ZBV) else 2
    dp = None if replicas == "none" else replicas
    return Column(name=f"{schedule}/{replicas}/t{tensor}/{recompute}/{stages}", schedule=kind,
                  batch_size=4 * (1 if dp is None else 2), microbatches=microbatches, tensor_parallel=tensor,
                  recompute_first_block=recompute == "selective", replicas=dp, compiled=stages == "compiled",
                  registry=MODELS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--replicas", nargs="+", default=list(REPLICAS), choices=REPLICAS)
    parser.add_argument("--tensor", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    parser.add_argument("--recompute", nargs="+", default=list(RECOMPUTE), choices=RECOMPUTE)
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "composition_matrix.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    columns = [column(*c) for c in itertools.product(args.schedules, args.replicas, args.tensor, args.recompute,
                                                      args.stages)]
    rows = sweep(args.models, columns, [2], args.timeout, measured=False)
    for row in rows:
        row.pop("traceback", None)  # the JSON keeps the line, not the stack
    meta = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "plans": "fixed cost table", "command": sys.argv}
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, sort_keys=True) + "\n")
    print(table(rows))
    return 0 if all(r["status"] in ("pass", "refused") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
