"""Run a function on K forked ranks over gloo; collect results or the first rank's traceback.

Ranks are forked (not spawned: spawn re-imports torch per rank, ~50x slower), rendezvous
through a FileStore in a temporary directory (no ports), run with one thread each, and are
killed when the deadline passes, so a hung rank fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _rank_main(fn: Callable[..., Any], rank: int, world: int, store: str, out: str,
               timeout: float, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    code = 0
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world, *args)
        torch.save({"ok": result}, f"{out}/{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, f"{out}/{rank}.pt")
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(code)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              collective_timeout: float = 60.0, allow_missing: bool = False) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each on its own forked process.

    ``allow_missing``: a rank that died without a result gives None instead of an error.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        store, out = f"{tmp}/store", f"{tmp}/out"
        Path(out).mkdir()
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world, store, out, collective_timeout, args))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        errors = []
        for r in range(world):
            path = Path(f"{out}/{r}.pt")
            if path.exists():
                data = torch.load(path, weights_only=False)
            else:
                data = {} if allow_missing else {"error": "no result"}
            if "error" in data:
                errors.append(f"--- rank {r} (exit code {procs[r].exitcode}) ---\n{data['error']}")
            results.append(data.get("ok"))
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout} s\n" + "\n".join(errors))
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
