"""Coverage of real models: capture, plan and train each zoo model at K stages, check parity.

For every K, one set of forked gloo ranks compiles every model of ``examples/zoo.py``, runs one
training step and returns its loss, gradients and buffers; this process runs the plain model
microbatch by microbatch and compares (``examples.zoo.compare``). A model that fails on some
rank is reported with its error instead of stopping the others. The table goes to a JSON file
and to the "## Coverage" section of ``benchmarks/RESULTS.md`` (other sections are left alone).

    .venv/bin/python benchmarks/coverage.py     # all models, K = 2 and 4, GPipe and 1F1B
    .venv/bin/python benchmarks/coverage.py --models gpt2 t5 --stages 2 --schedules 1f1b
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples import zoo  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

ATOL, RTOL = 1e-5, 1e-4
"""The tolerances of tests/multiprocess/test_zoo.py (justified there)."""

NOTES = {
    "resnet": "BatchNorm buffers (train mode), ModelOutput",
    "vit": "patch embedding, CLS token, ModelOutput",
    "gpt2": "tied embeddings on first and last stage, keyword input",
    "bert": "keyword input_ids + attention_mask, tied MLM decoder",
    "llama": "rotary embeddings (inv_freq buffer), GQA",
    "qwen2": "rotary embeddings, attention biases",
    "t5": "encoder-decoder, two inputs (input_ids, decoder_input_ids)",
    "tagger": "symbolic_trace; dict output, BatchNorm, torch.Size/ints cross cuts",
    "tv_resnet18": "torchvision ResNet-18: BatchNorm, in-place ReLU and +=",
    "tv_vit": "torchvision VisionTransformer: class token, sizes cross cuts",
}


def _models_on_rank(rank: int, world: int, names: list[str], microbatches: int,
                    schedule: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        try:
            out[name] = zoo.pipelined_step(rank, world, name, microbatches, schedule=schedule)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                         "traceback": traceback.format_exc()}
        out[name]["seconds"] = time.perf_counter() - start
    return out


def run(names: list[str], stages: list[int], microbatches: int,
        schedules: tuple[str, ...] = ("gpipe",)) -> list[dict[str, Any]]:
    rows = []
    for schedule, k in [(s, k) for s in schedules for k in stages]:
        results = run_ranks(_models_on_rank, k, names, microbatches, schedule, timeout=600)
        for name in names:
            per_rank = [r[name] for r in results]
            row: dict[str, Any] = {"model": name, "K": k, "microbatches": microbatches, "schedule": schedule,
                                   "note": NOTES.get(name, ""),
                                   "seconds": round(max(r["seconds"] for r in per_rank), 1)}
            failed: dict[str, list[int]] = {}
            for i, r in enumerate(per_rank):
                if "error" in r:
                    failed.setdefault(r["error"], []).append(i)
            if failed:
                error = "; ".join(f"ranks {ranks}: {msg}" for msg, ranks in failed.items())
                rows.append({**row, "capture": "-", "parity": "fail", "error": error})
                continue
            try:
                report = zoo.compare(zoo.reference_step(name, microbatches), per_rank, ATOL, RTOL)
                rows.append({**row, **report, "parity": "pass"})
            except AssertionError as e:
                rows.append({**row, "capture": per_rank[0]["capture"], "parity": "fail",
                             "error": str(e).splitlines()[0][:300]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | capture | K | schedule | nodes per stage | constants crossing cuts | "
        "max abs err | max rel err | parity | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["parity"] == "pass":
            cells = ["/".join(map(str, r["stages"])), str(r["cut_constants"]),
                     f"{r['max_abs']:.1e}", f"{r['max_rel']:.1e}", "pass", r["note"]]
        else:
            cells = ["-", "-", "-", "-", "**fail**", r["error"].replace("|", "\\|")]
        lines.append("| " + " | ".join([r["model"], r["capture"], str(r["K"]), r["schedule"], *cells]) + " |")
    return "\n".join(lines)


def section(rows: list[dict[str, Any]], microbatches: int, title: str = "## Coverage") -> str:
    passed = sum(r["parity"] == "pass" for r in rows)
    if title != "## Coverage":
        return (
            f"{title}\n\n`.venv-newest/bin/python {shlex.join(sys.argv)}` (torch {torch.__version__}): the same check as "
            f"above. {passed}/{len(rows)} scenarios pass.\n\n{table(rows)}\n"
        )
    return (
        "## Coverage\n\n"
        f"Real models from `examples/zoo.py` (Hugging Face configs, random weights, 2 layers, "
        f"hidden 64, dropout 0, batch 8, {microbatches} microbatches), captured, planned "
        f"and trained one step on K forked gloo ranks (CPU), then compared with the plain model "
        f"run microbatch by microbatch: loss on every rank, every parameter's gradient, every "
        f"buffer. Parity means `assert_close(atol={ATOL:g}, rtol={RTOL:g})` on all of them (the "
        f"errors are the largest over all tensors; the relative one is normwise, max|err| / "
        f"max|ref| per tensor). "
        f"{passed}/{len(rows)} scenarios pass.\n\n"
        f"Regenerate: `.venv/bin/python benchmarks/coverage.py` (writes "
        f"`benchmarks/coverage.json` and this section).\n\n"
        f"{table(rows)}\n\n"
        "torchvision models need torch 2.14.1 + torchvision 0.29.1 (`make vision`; torchvision "
        "does not import beside the torch 2.13.0 CPU build): their table is the next section. "
        "timm is not covered. Every Hugging Face model "
        "goes through the torch.export fallback (symbolic_trace fails on their data-dependent "
        "control flow), so its shapes are specialised and no non-tensor value crosses a cut; "
        "`tagger` covers symbolic_trace, where a `torch.Size` and ints do. Checkpoints (save "
        "with K=2, load with K=3 and into the plain model; a killed run resumed bitwise) are "
        "tested in `tests/multiprocess/test_checkpoint.py`.\n"
    )


def write_section(path: Path, text: str, title: str = "## Coverage") -> None:
    """Replace (or append) the ``title`` section of ``path``, leaving the rest as it is."""
    current = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(current):
        updated = pattern.sub(lambda _: text + "\n", current, count=1)
    else:
        updated = current.rstrip("\n") + "\n\n" + text
    path.write_text(updated.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(zoo.ZOO), choices=list(zoo.ZOO))
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "coverage.json")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md",
                        help="markdown file whose '## Coverage' section is rewritten ('' to skip)")
    parser.add_argument("--title", default="## Coverage", help="the section to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(args.models, args.stages, args.microbatches, tuple(args.schedules))
    meta = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, sort_keys=True) + "\n")
    text = section(rows, args.microbatches, args.title)
    print(text)
    if str(args.results):
        write_section(args.results, text, args.title)
    return 0 if all(r["parity"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
