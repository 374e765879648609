"""Running many fuzzer configurations on few forks, and shrinking a failing one.

Compiling is cheap with a given or fast plan (~0.5 s), forking and joining a process group
is not free, so a pool of ``world`` forked ranks (gloo over a FileStore, one thread each, as
tests/harness.py) runs a whole list of configurations with the same world size one after the
other, writing each configuration's result per rank as soon as it has it. A rank that fails
stops (pipecut tears its process groups down on a failure; see runtime/comm/failure.py), the other
ranks then fail or time out, and the driver starts a fresh pool for the configurations left.
A pool that makes no progress for ``job_timeout`` seconds is killed: the configuration it was
running is a hang.

Shrinking is our own, over the :class:`~tests.fuzz_config.Config` dataclass (hypothesis cannot
shrink an example whose run spans several processes of a pool): greedily, each field is set
to a simpler value (:func:`tests.fuzz_config.simpler`) and the change kept while the
configuration still fails the same way (mismatch, error or hang).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import re
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecut.errors import PipecutError, PipelineRuntimeError
from tests.fuzz_check import Mismatch, check
from tests.fuzz_config import Config, simpler
from tests.fuzz_run import Trail, make_plan, run_config

FAILURES = ("mismatch", "error", "hang")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    config: Config
    kind: str
    """match, refused (a PipecutError where the run met something new: a pass), or one of
    :data:`FAILURES`."""
    detail: str = ""
    error: str = ""
    """A refusal's or an error's exception class (``InputError``...)."""
    at: str = ""
    """Where a refusal or an error was raised: ``plan`` (in the driver), ``compile``, ``step 1
    call 0``..."""
    errors: tuple[tuple[str, float], ...] = ()
    """A match's worst errors against the plain model (:func:`tests.fuzz_check.compare`)."""
    ran: tuple[str, int] | None = None
    """The schedule and microbatch count the ranks ran (compile may have chosen them), where
    they got that far."""

    @property
    def failed(self) -> bool:
        return self.kind in FAILURES

    @property
    def signature(self) -> str:
        """What failed, without numbers and names: the kind and, for an error, its last line
        (the exception); for a mismatch, which quantity (loss, grad, weight, norm, buffer...)."""
        if self.kind == "error":
            text = self.detail.split("\nevery rank's error:")[0].strip().splitlines()[-1]
        elif self.kind == "mismatch":
            found = re.search(r"(loss|grad|weight|clip_grad_norm_|buffer|gradients on no rank|scale)", self.detail)
            text = found.group(1) if found else ""
        else:
            text = ""
        return f"{self.kind} {re.sub(r'[0-9]+', 'N', text)[:160]}".strip()


def _rank_main(jobs: Sequence[tuple[Config, Any]], rank: int, world: int, store: str, out: str,
               timeout: float) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        for i, (cfg, plan) in enumerate(jobs):
            trail = Trail()
            try:
                result: dict[str, Any] = {"ok": run_config(rank, world, cfg, plan, timeout, trail)}
            except BaseException as e:
                result = {"error": traceback.format_exc(), "type": type(e).__name__, "message": str(e),
                          "refusal": is_refusal(cfg, e, trail), "at": trail.at}
            torch.save(result, f"{out}/{i}-{rank}.pt")
            if "error" in result:
                break
    finally:
        os._exit(0)


def is_refusal(cfg: Config, error: BaseException, trail: Trail) -> bool:
    """Is ``error`` pipecut refusing what the run met at ``trail`` (a pass)?

    A PipecutError raised where the run meets something for the first time (compile, the
    first step, a smaller last batch, the first clip or eval, the step after a freeze); not one
    raised by a call that passed before (the same batch, the same flags), which is a bug. A
    PipelineRuntimeError (a rank failed, timed out, or received what the plan did not say, or
    a torch error wrapped) counts only as pipecut's check, after a freeze or an unfreeze, that
    the parameters' ``requires_grad`` still match the plan (runtime/execution/forward.py:
    check_grad_flags)."""
    if not isinstance(error, PipecutError) or not trail.novel:
        return False
    if isinstance(error, PipelineRuntimeError):  # not a torch error wrapped, nor a rank that failed
        freezing = "frozen" in trail.kind or "unfrozen again" in trail.kind
        return freezing and "requires_grad changed after pipecut.compile" in str(error)
    return True


def _pool(jobs: Sequence[tuple[Config, Any]], world: int, job_timeout: float) -> dict[int, list[dict[str, Any]]]:
    """Run ``jobs`` on one pool; job index -> every rank's result, for the jobs that have one."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        store, out = f"{tmp}/store", Path(tmp, "out")
        out.mkdir()
        procs = [ctx.Process(target=_rank_main, args=(jobs, r, world, store, str(out), job_timeout))
                 for r in range(world)]
        for p in procs:
            p.start()
        seen, last = 0, time.monotonic()
        while any(p.is_alive() for p in procs):
            time.sleep(0.05)
            count = len(list(out.iterdir()))
            if count != seen:
                seen, last = count, time.monotonic()
            elif time.monotonic() - last > job_timeout + 15:
                break
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results: dict[int, list[dict[str, Any]]] = {}
        for i in range(len(jobs)):
            files = [out / f"{i}-{r}.pt" for r in range(world)]
            if any(f.exists() for f in files):
                results[i] = [torch.load(f, weights_only=False) if f.exists() else {} for f in files]
        return results


def _judge(cfg: Config, ranks: list[dict[str, Any]]) -> Outcome:
    """A job's outcome from its ranks' results (a missing result: the rank never got there)."""
    errors = [r for r in ranks if "error" in r]
    refusals = [r for r in errors if r["refusal"]]
    if refusals:
        first = refusals[0]
        return Outcome(config=cfg, kind="refused", detail=f"{first['type']}: {first['message']}",
                       error=first["type"], at=first["at"])
    if errors:
        # The cause first: a rank's own error before one saying that another rank failed.
        own = sorted(errors, key=lambda r: (r["type"] == "PipelineRuntimeError",
                                            "stopped because" in r["message"] or "probably failed" in r["message"]))
        others = "".join(f"\n--- rank {i} at {r['at']}: {r['type']}: {r['message'][:300]}"
                         for i, r in enumerate(ranks) if "error" in r)
        return Outcome(config=cfg, kind="error", detail=own[0]["error"] + "\nevery rank's error:" + others,
                       error=own[0]["type"], at=own[0]["at"])
    if any("ok" not in r for r in ranks):
        return Outcome(config=cfg, kind="hang", detail="a rank returned nothing for this configuration")
    plan = json.loads(ranks[0]["ok"]["plan"])
    ran = (str(plan["schedule"]), int(plan["microbatches"]))
    try:
        worst = check(cfg, [r["ok"] for r in ranks])
    except Mismatch as e:
        return Outcome(config=cfg, kind="mismatch", detail=str(e), ran=ran)
    except Exception as e:
        return Outcome(config=cfg, kind="error", detail="in the reference:\n" + traceback.format_exc(),
                       error=type(e).__name__, at="reference", ran=ran)
    return Outcome(config=cfg, kind="match", errors=tuple(sorted(worst.items())), ran=ran)


def run_configs(configs: Sequence[Config], job_timeout: float = 60.0,
                progress: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Every configuration's outcome, in order; pools grouped by world size."""
    outcomes: dict[int, Outcome] = {}
    with tempfile.TemporaryDirectory() as folder:
        jobs: dict[int, list[tuple[int, Any]]] = {}
        plans: dict[Config, Any] = {}  # drawn configurations often share a plan
        for index, cfg in enumerate(configs):
            key = dataclasses.replace(cfg, autocast="off", accumulation=1, no_sync=False, last="same", freeze="",
                                      eval_between=False, data_parallel="none", steps=2, clip=None, seed=0)
            try:
                if key not in plans:
                    plans[key] = make_plan(cfg, Path(folder))
                plan = plans[key]
            except Exception as e:  # a PipecutError refuses; anything else is a bug in planning
                refused = isinstance(e, PipecutError)
                outcomes[index] = Outcome(
                    config=cfg, kind="refused" if refused else "error", error=type(e).__name__, at="plan",
                    detail=f"{type(e).__name__}: {e}" if refused else "in the driver's plan:\n" + traceback.format_exc())
                if progress:
                    progress(outcomes[index])
                continue
            jobs.setdefault(cfg.world, []).append((index, plan))
        for world, todo in sorted(jobs.items()):
            while todo:
                results = _pool([(configs[i], plan) for i, plan in todo], world, job_timeout)
                done = 0
                for pos, (index, _) in enumerate(todo):
                    if pos not in results:
                        break
                    outcomes[index] = _judge(configs[index], results[pos])
                    done = pos + 1
                    if progress:
                        progress(outcomes[index])
                    if any("ok" not in r for r in results[pos]):
                        break  # this job stopped the pool
                if done == 0:  # the first job never finished anywhere: it hung
                    index = todo[0][0]
                    outcomes[index] = Outcome(config=configs[index], kind="hang",
                                              detail=f"no rank finished within {job_timeout} s")
                    if progress:
                        progress(outcomes[index])
                    done = 1
                todo = todo[done:]
    return [outcomes[i] for i in range(len(configs))]


def shrink(outcome: Outcome, job_timeout: float = 60.0, budget: int = 60) -> tuple[Outcome, int]:
    """The simplest configuration found that fails as ``outcome`` does (same
    :attr:`Outcome.signature`), and the runs it took."""
    best, runs = outcome, 0
    improved = True
    while improved and runs < budget:
        improved = False
        for candidate in simpler(best.config):
            runs += 1
            (result,) = run_configs([candidate], job_timeout)
            if result.signature == best.signature:
                best, improved = result, True
                break
            if runs >= budget:
                break
    return best, runs
