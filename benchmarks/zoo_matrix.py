"""The issue 27 matrix: every architecture of examples/architectures.py under every schedule.

Each cell is one (architecture, column) pair: its own forked gloo ranks (``run_ranks``, with a
timeout, so one hang cannot stop the sweep) compile the model, run one training step and
return the loss, gradients and buffers; this process runs the plain model microbatch by
microbatch and compares (``examples.zoo.compare``, the tolerances of tests/multiprocess/test_zoo.py).
A cell reads

- ``pass``: loss, every gradient and every buffer match;
- ``FAIL(tensor, max abs err)``: a silent difference, the first tensor off and by how much;
- ``refused(Class)``: a pipecut error (``pipecut.errors``) before any step: match or refuse, it refused;
- ``error(Class)``: any other exception, or a rank's failure inside a step
  (``PipelineRuntimeError``): itself a bug to fix;
- ``timeout``: the ranks ran past ``--timeout`` seconds and were killed.

Columns: GPipe, 1F1B and zero-bubble split batch 4 into 2 microbatches; interleaved 1F1B (2
stages per rank) and ZBV split 4 into 4; ``zero-bubble-1`` is ViT's case of one sample per
microbatch (batch 2 in 2) under zero-bubble; the ``tp2-`` columns (not run by default) split
each of the K stages over 2 ranks (DTensor), ``-sp-`` with sequence parallelism: 1F1B and
GPipe with batch 4 in 2, interleaved 1F1B with batch 4 in 4; ``-selective-``: each stage
recomputes its first block; ``-eager``: the models built with eager attention instead of
transformers' default (SDPA where the model has it, as every other column); the ``dp2-``
columns run two replicas of the pipeline (DDP under zero-bubble, FSDP2 under ZBV), each on
half of a batch of 8, against the plain model on the whole batch. Plans come from a fixed cost table
(``examples.pinned``: every node the same cost), so a cell gives the same answer on every run;
``--measured`` plans from timings instead, calibrated on the running pipeline, as a user's
``compile`` does (the runtime's paths after calibration: a rebuilt split, a re-costed order).

    .venv/bin/python benchmarks/zoo_matrix.py                                  # everything, K = 2
    .venv/bin/python benchmarks/zoo_matrix.py --models t5 bart --schedules zbv --timeout 120
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.coverage import ATOL, RTOL, write_section  # noqa: E402
from examples import pinned, zoo  # noqa: E402
from examples.architectures import ARCHITECTURES  # noqa: E402
from pipecut import MeasureOptions, ScheduleKind, TensorParallelOptions  # noqa: E402
from pipecut.errors import PipecutError, PipelineRuntimeError  # noqa: E402
from tests.harness import run_ranks  # noqa: E402


@dataclass(frozen=True, kw_only=True, slots=True)
class Column:
    """A schedule and how the batch is split: one column of the table."""

    name: str
    schedule: ScheduleKind
    batch_size: int
    microbatches: int
    tensor_parallel: int = 1
    """T: each of the K stages split over T ranks (a ("pp", "tp") mesh of K x T ranks)."""
    sequence_parallel: bool = False
    recompute_first_block: bool = False
    """Each stage recomputes its first block (selective recompute: ``pinned.first_block_recomputed``)."""
    attention: str | None = None
    """The models' attention: None, transformers' default (what a user gets: SDPA where the
    model has it); ``"eager"`` for the ``-eager`` columns."""
    replicas: str | None = None
    """Two replicas of the pipeline kept in step by this engine ("ddp", "fsdp"; a ("dp", "pp")
    or ("dp", "pp", "tp") mesh), each on half the batch; None: one pipeline."""
    compiled: bool = False
    """The stages run through torch.compile (``compile_stages=True``)."""
    registry: Any = None
    """The factories by name (None: the architectures)."""

    @property
    def models(self) -> dict[str, Any]:
        """The architectures as this column builds them."""
        registry = ARCHITECTURES if self.registry is None else self.registry
        if self.attention is None:
            return registry
        return {n: functools.partial(f, attention=self.attention) for n, f in registry.items()}

    @property
    def replica_count(self) -> int:
        return 1 if self.replicas is None else 2

    def ranks(self, k: int) -> int:
        """The ranks a cell at K stages runs on: D x K x T."""
        return self.replica_count * k * self.tensor_parallel

    def mesh(self, world: int) -> Any:
        """The DeviceMesh of a cell (None: plain ranks)."""
        dims = [("dp", self.replica_count)] if self.replicas else []
        dims.append(("pp", world // (self.replica_count * self.tensor_parallel)))
        if self.tensor_parallel > 1:
            dims.append(("tp", self.tensor_parallel))
        if len(dims) == 1:
            return None
        return init_device_mesh("cpu", tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims))


COLUMNS = (
    Column(name="gpipe", schedule=ScheduleKind.GPIPE, batch_size=4, microbatches=2),
    Column(name="1f1b", schedule=ScheduleKind.ONE_F_ONE_B, batch_size=4, microbatches=2),
    Column(name="interleaved-1f1b", schedule=ScheduleKind.INTERLEAVED_1F1B, batch_size=4, microbatches=4),
    Column(name="zero-bubble", schedule=ScheduleKind.ZERO_BUBBLE, batch_size=4, microbatches=2),
    Column(name="zbv", schedule=ScheduleKind.ZBV, batch_size=4, microbatches=4),
    Column(name="zero-bubble-1", schedule=ScheduleKind.ZERO_BUBBLE, batch_size=2, microbatches=2),
    Column(name="1f1b-eager", schedule=ScheduleKind.ONE_F_ONE_B, batch_size=4, microbatches=2, attention="eager"),
    Column(name="tp2-1f1b", schedule=ScheduleKind.ONE_F_ONE_B, batch_size=4, microbatches=2, tensor_parallel=2),
    Column(name="tp2-1f1b-eager", schedule=ScheduleKind.ONE_F_ONE_B, batch_size=4, microbatches=2, tensor_parallel=2,
           attention="eager"),
    Column(name="tp2-sp-1f1b", schedule=ScheduleKind.ONE_F_ONE_B, batch_size=4, microbatches=2, tensor_parallel=2,
           sequence_parallel=True),
    Column(name="tp2-sp-gpipe", schedule=ScheduleKind.GPIPE, batch_size=4, microbatches=2, tensor_parallel=2,
           sequence_parallel=True),
    Column(name="tp2-sp-interleaved-1f1b", schedule=ScheduleKind.INTERLEAVED_1F1B, batch_size=4, microbatches=4,
           tensor_parallel=2, sequence_parallel=True),
    Column(name="tp2-sp-selective-1f1b", schedule=ScheduleKind.ONE_F_ONE_B, batch_size=4, microbatches=2,
           tensor_parallel=2, sequence_parallel=True, recompute_first_block=True),
    Column(name="tp2-zero-bubble", schedule=ScheduleKind.ZERO_BUBBLE, batch_size=4, microbatches=2, tensor_parallel=2),
    Column(name="tp2-sp-zbv", schedule=ScheduleKind.ZBV, batch_size=4, microbatches=4, tensor_parallel=2,
           sequence_parallel=True),
    Column(name="dp2-ddp-zero-bubble", schedule=ScheduleKind.ZERO_BUBBLE, batch_size=8, microbatches=2, replicas="ddp"),
    Column(name="dp2-fsdp-zbv", schedule=ScheduleKind.ZBV, batch_size=8, microbatches=4, replicas="fsdp"),
)
DEFAULT = [c.name for c in COLUMNS if c.tensor_parallel == 1 and c.attention is None]
BY_NAME = {c.name: c for c in COLUMNS}


def _cell_on_rank(rank: int, world: int, name: str, column: Column, plan: Any, measured: bool) -> dict[str, Any]:
    """One rank's step, or its error as data (so that the other rank's result still comes back)."""
    try:
        devices = column.mesh(world)
        split = TensorParallelOptions(sequence_parallel=column.sequence_parallel) if column.tensor_parallel > 1 else None
        return zoo.pipelined_step(rank, world, name, column.microbatches, batch_size=column.batch_size,
                                  schedule=column.schedule, models=column.models, plan=plan,
                                  measure=MeasureOptions() if measured else None, devices=devices,
                                  tensor_parallel=split, data_parallel=column.replicas,
                                  compile_stages=column.compiled,
                                  # a cold compile on a loaded machine keeps a peer waiting past 60 s
                                  timeout=300.0 if column.compiled else 60.0)
    except Exception as e:
        return {"error": _error_line(e), "refused": _refusal(e),
                "kind": type(e).__name__, "traceback": traceback.format_exc()}


def _refusal(e: BaseException) -> bool:
    """A pipecut error raised before any step (a plan or input refused), not a rank's failure
    inside a step, which pipecut reports as a ``PipelineRuntimeError``."""
    return isinstance(e, PipecutError) and not isinstance(e, PipelineRuntimeError)


def _error_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def _mismatch(e: AssertionError) -> tuple[str, float | None]:
    """The first tensor off and its greatest absolute difference, from assert_close's message."""
    text = str(e)
    first = re.sub(r"^rank \d+ ", "", text.splitlines()[0].split(":")[0]) if text else "?"
    found = re.search(r"(?:Greatest absolute|Absolute) difference: (\S+)", text)
    return first, float(found.group(1)) if found else None


def _row(name: str, column: Column, k: int) -> dict[str, Any]:
    return {"model": name, "column": column.name, "K": k, "schedule": column.schedule.value,
            "batch_size": column.batch_size, "microbatches": column.microbatches}


def run_cell(name: str, column: Column, k: int, timeout: float, plan: Any, measured: bool = False) -> dict[str, Any]:
    """The row of one cell: its status and what explains it. Without ``plan``, ``measured``
    plans from timings and calibrates on the running pipeline (else from counted costs)."""
    row = _row(name, column, k)
    start = time.perf_counter()
    try:
        ranks = run_ranks(_cell_on_rank, column.ranks(k), name, column, plan, measured, timeout=timeout)
    except TimeoutError as e:
        return {**row, "status": "timeout", "detail": str(e).splitlines()[0],
                "seconds": round(time.perf_counter() - start, 1)}
    except RuntimeError as e:  # a rank died without a result
        return {**row, "status": "error", "kind": "crash", "detail": str(e).splitlines()[-1][:300],
                "seconds": round(time.perf_counter() - start, 1)}
    row["seconds"] = round(time.perf_counter() - start, 1)
    failed = [(r, out) for r, out in enumerate(ranks) if "error" in out]
    if failed:
        r, out = failed[0]
        return {**row, "status": "refused" if out["refused"] else "error", "kind": out["kind"],
                "detail": f"rank {r}: {out['error']}", "traceback": out["traceback"]}
    try:
        report = zoo.compare(_reference(name, column, timeout), ranks, ATOL, RTOL)
    except AssertionError as e:
        tensor, max_abs = _mismatch(e)
        return {**row, "status": "FAIL", "tensor": tensor, "max_abs": max_abs,
                "detail": f"{str(e).splitlines()[0][:300]} (max abs err {max_abs})"}
    return {**row, "status": "pass", **report}


def _reference(name: str, column: Column, timeout: float) -> Any:
    """The plain model's step, in a forked process of its own: a backward in this process would
    start autograd's device threads, after which torch 2.14's CUDA build refuses every backward
    in the ranks forked for the next cell ("Unable to handle autograd's threading in
    combination with fork-based multiprocessing")."""
    def step(rank: int, world: int) -> Any:  # replicas: the same microbatches, the whole batch's mean
        loss, model = zoo.reference_step(name, column.microbatches * column.replica_count, batch_size=column.batch_size,
                                         models=column.models)
        return loss, model, {n: p.grad for n, p in model.named_parameters()}  # a saved module keeps no .grad

    loss, model, grads = run_ranks(step, 1, timeout=timeout)[0]
    for n, p in model.named_parameters():
        p.grad = grads[n]
    return loss, model


def _plan(name: str, column: Column, k: int, costs: dict[tuple[int, int, str | None], pinned.FixedCosts]) -> Any:
    share = column.batch_size // column.replica_count  # a replica's plan is at its share of the batch
    key = (share, column.microbatches, column.attention)
    if key not in costs:
        costs[key] = pinned.fixed_costs(name, column.microbatches, models=column.models, batch_size=share)
    plan = pinned.fixed_plan(costs[key], k, column.schedule)
    return pinned.first_block_recomputed(plan) if column.recompute_first_block else plan


def sweep(names: list[str], columns: list[Column], stages: list[int], timeout: float,
          measured: bool) -> list[dict[str, Any]]:
    """Every cell, architecture by architecture (each model's graph captured once per size)."""
    rows = []
    for name in names:
        costs: dict[tuple[int, int, str | None], pinned.FixedCosts] = {}
        for k, column in [(k, c) for k in stages for c in columns]:
            try:
                plan = None if measured else _plan(name, column, k, costs)
            except Exception as e:  # capture or partition refused before any rank ran
                rows.append({**_row(name, column, k), "seconds": 0.0, "kind": type(e).__name__,
                             "status": "refused" if _refusal(e) else "error",
                             "detail": f"planning: {_error_line(e)}", "traceback": traceback.format_exc()})
            else:
                rows.append(run_cell(name, column, k, timeout, plan, measured))
            print(_progress(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _progress(row: dict[str, Any]) -> str:
    return f"{row['model']:>12} K={row['K']} {row['column']:<16} {cell(row):<40} {row['seconds']:6.1f} s"


def cell(row: dict[str, Any]) -> str:
    status = row["status"]
    if status == "FAIL":
        err = "?" if row["max_abs"] is None else f"{row['max_abs']:.1e}"
        return f"**FAIL**({row['tensor']}, {err})"
    if status in ("refused", "error"):
        return f"{status}({row['kind']})"
    return status


def table(rows: list[dict[str, Any]]) -> str:
    """Rows architectures, columns schedules (one table per K), then every non-pass cell's line."""
    out = []
    for k in sorted({r["K"] for r in rows}):
        names = list(dict.fromkeys(r["model"] for r in rows if r["K"] == k))
        columns = list(dict.fromkeys(r["column"] for r in rows if r["K"] == k))
        at = {(r["model"], r["column"]): r for r in rows if r["K"] == k}
        out += [f"K = {k}\n", "| architecture | " + " | ".join(columns) + " |",
                "|---" * (len(columns) + 1) + "|"]
        for name in names:
            cells = [cell(at[name, c]) if (name, c) in at else "-" for c in columns]
            out.append(f"| {name} | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    bad = [r for r in rows if r["status"] != "pass"]
    passed = len(rows) - len(bad)
    out.append(f"{passed}/{len(rows)} cells pass.\n")
    out += [f"- {r['model']} / {r['column']} (K={r['K']}): {r['status']}: {r['detail']}" for r in bad]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(ARCHITECTURES), choices=sorted(ARCHITECTURES))
    parser.add_argument("--schedules", nargs="+", default=DEFAULT, choices=list(BY_NAME),
                        help="columns: a schedule, zero-bubble-1 (one sample per microbatch), or "
                             "a tp2-... column (each stage over 2 ranks; -sp-: with sequence parallelism)")
    parser.add_argument("--stages", nargs="+", type=int, default=[2])
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per cell")
    parser.add_argument("--measured", action="store_true",
                        help="plan from timings (compile's default) instead of a fixed cost table")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "zoo_matrix.json")
    parser.add_argument("--results", type=Path, default=None,
                        help="a markdown file whose '## Zoo matrix' section is rewritten (default: none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = sweep(args.models, [BY_NAME[c] for c in args.schedules], args.stages, args.timeout, args.measured)
    meta = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "plans": "measured" if args.measured else "fixed cost table", "command": sys.argv}
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, sort_keys=True) + "\n")
    text = table(rows)
    print(text)
    if args.results is not None:
        write_section(args.results, f"## Zoo matrix\n\n{text}\n", "## Zoo matrix")
    return 0 if all(r["status"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
