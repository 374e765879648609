"""Estimating real-size models for hardware that is not here: time and memory on this machine.

    .venv/bin/python benchmarks/estimate_scale.py                 # all rows, markdown table
    .venv/bin/python benchmarks/estimate_scale.py --models 8b     # one model

Each row runs in a fresh process (so its peak RSS is its own, read from ``os.wait4``):

- ``<size> estimate``: ``pipecut.estimate_costs`` of Llama-3.1-<size> (``examples/llama_meta.py``:
  built on the meta device in bfloat16, 8 sequences of 8,192 tokens, one microbatch of 8 counted)
  for an H100-SXM: capture (torch.export) and the fake-tensor count, no arithmetic;
- ``8b plan (CLI)``: the whole ``pipecut plan examples.llama_meta:build_8b --device-profile
  H100-SXM --devices 8 --microbatches 8 --schedule 1f1b``.

Seconds are wall-clock on this machine (2 CPU cores shared with other work: expect drift; "process
CPU s" is the child's user + system time, which the sharing moves less, and "load" the 1-minute
load average when the row finished); "estimate s" is the ``estimate_costs`` call alone and
"capture s" the part of it spent in ``pipecut.capture.capture``. Results go to
``benchmarks/estimate_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples/
SIZES = ("8b", "70b", "405b")
CLI = ["plan", "examples.llama_meta:build_8b", "--device-profile", "H100-SXM", "--devices", "8",
       "--microbatches", "8", "--schedule", "1f1b", "-q"]


def one(size: str) -> dict[str, object]:
    """In the child: estimate Llama-3.1-``size`` and report what it took."""
    import pipecut.profile.devices
    from examples.llama_meta import build

    spent = [0.0]
    capture = pipecut.profile.devices.capture

    def timed_capture(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return capture(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent[0] += time.perf_counter() - start

    pipecut.profile.devices.capture = timed_capture  # type: ignore[assignment]
    model, inputs, loss_fn, target = build(size)
    start = time.perf_counter()
    rows = pipecut.profile.devices.estimate_costs(model, inputs, "H100-SXM", microbatches=8, loss_fn=loss_fn,
                                          target=target)
    seconds = time.perf_counter() - start
    return {
        "nodes": len(rows), "seconds": seconds, "capture_seconds": spent[0],
        "forward_ms": sum(r.forward_ms for r in rows), "backward_ms": sum(r.backward_ms for r in rows),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _run(command: list[str]) -> tuple[float, float, int, str]:
    """Wall seconds, CPU seconds (user + system), peak RSS (bytes) and stdout of one child process."""
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdout is not None
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed (status {status})")
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[*SIZES, "8b-cli"], choices=[*SIZES, "8b-cli"])
    parser.add_argument("--one", choices=SIZES, help=argparse.SUPPRESS)  # the child's entry
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "estimate_scale.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    results = []
    for name in args.models:
        if name == "8b-cli":
            wall, cpu, rss, _ = _run([sys.executable, "-m", "pipecut", *CLI])
            row: dict[str, object] = {"model": "8b plan (CLI)"}
        else:
            wall, cpu, rss, out = _run([sys.executable, __file__, "--one", name])
            row = {"model": f"{name} estimate", **json.loads(out.strip().splitlines()[-1])}
        row.update(process_seconds=wall, cpu_seconds=cpu, peak_rss_bytes=rss, load=os.getloadavg()[0])
        results.append(row)
        print(f"done {row['model']}: {wall:.1f} s", file=sys.stderr)
    print("| model | estimate s | capture s | process s | process CPU s | peak RSS | nodes | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        est = f"{r['seconds']:.1f}" if "seconds" in r else "–"
        cap = f"{r['capture_seconds']:.1f}" if "capture_seconds" in r else "–"
        print(f"| {r['model']} | {est} | {cap} | {r['process_seconds']:.1f} | {r['cpu_seconds']:.1f} | "
              f"{r['peak_rss_bytes'] / 2**30:.2f} GiB | {r.get('nodes', '–')} | {r['load']:.1f} |")
    Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
