"""Runtime benchmark: pipecut's schedules against torch.distributed.pipelining and one process.

    .venv/bin/python benchmarks/runtime.py [--rounds 5] [--steps 2] [--models gpt,mlp,...]
        [--schedules gpipe,1f1b,zero-bubble,zbv,1f1b+compiled] [--no-pippy] [--compiled]

Two forked CPU ranks on gloo, one thread each; batch 16 in 8 microbatches. For each model:
one plain process on the full batch (one thread), pipecut under each schedule, and
torch.distributed.pipelining's GPipe cut at the module boundary nearest pipecut's cut. Step time
is the median over ``--steps`` timed steps after two warm-up steps (forward + backward; no
optimizer step in any of them). ZBV cuts the model into four stages, two per rank on a V (rank 0
runs the first and the last). After the runs, a second table gives each pipecut runner's
predicted against measured step and the error, with each rank's measured forward and backward
per microbatch (its stages together, from the timeline of one recorded step) against the
plan's, which shows where a prediction is off. A schedule ``S+compiled`` runs pipecut with
``compile_stages=True`` against one compiled process, with its compile times cold (an empty
inductor cache, made for this run and shared by the ranks) and warm (a second run replaying its
plan on that cache); ``--compiled`` adds torch.distributed.pipelining with its stage modules
compiled. ``benchmarks/compiled.py`` times compiled against eager in alternation. Prints the tables and writes JSON. Not a test: numbers depend on
the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from examples import gpt, mlp, resnet
from pipecut.passes.costs.stages import build_stages
from pipecut.passes.partition.chain import liveness
from tests.harness import run_ranks

BATCH, MICROBATCHES, WORLD = 16, 8, 2


def _next_token_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a language model's logits. pipecut hands the loss the model's
    ModelOutput; torch.distributed.pipelining its flattened first output (the logits tensor)."""
    logits = out.logits if hasattr(out, "logits") else out if isinstance(out, torch.Tensor) else out[0]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def hf_gpt2(batch_size: int = BATCH, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=6, n_head=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 2048, (batch_size, 129))

    return model, {"input_ids": tokens[:, :-1]}, _next_token_loss, tokens[:, 1:]


def hf_llama(batch_size: int = BATCH, seed: int = 0, layers: int = 8) -> tuple[Any, Any, Any, Any]:
    """transformers' Llama, ``layers`` blocks of GPT-2's size above (hidden 256, 8 heads, 2 KV
    heads, MLP 688, 2,048 tokens of vocabulary, 128 per sample), random weights: issue 29's
    8-layer Llama at K = 2, batch 16 in 8 microbatches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                         attention_dropout=0.0, use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, 2048, (batch_size, 129))

    return model, {"input_ids": tokens[:, :-1]}, _next_token_loss, tokens[:, 1:]


def hf_resnet50(batch_size: int = BATCH, seed: int = 0, image: int = 224) -> tuple[Any, Any, Any, Any]:
    """transformers' ResNet-50 (its default config: bottleneck blocks 3-4-6-3, widths 256-2048),
    random weights, ``image`` x ``image`` pictures. At 224 one step of 16 takes about 7 s on one
    core; at 64 the microbatches of 2 are so small that they run 2.5x slower than the batch."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    model = ResNetForImageClassification(ResNetConfig(num_labels=10))
    pictures = torch.randn(batch_size, 3, image, image)

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out if isinstance(out, torch.Tensor) else out[0]
        return F.cross_entropy(logits, target)

    return model, {"pixel_values": pictures}, loss_fn, torch.randint(0, 10, (batch_size,))


MODELS: dict[str, Callable[..., Any]] = {
    "gpt": gpt.build_demo,
    "mlp": lambda batch_size=BATCH, seed=0: mlp.build(batch_size, seed, width=1024, depth=8),
    "resnet": lambda batch_size=BATCH, seed=0: resnet.build(batch_size, seed, image=64),
    "hf_gpt2": hf_gpt2,
    "hf_llama": hf_llama,
    "hf_resnet50": hf_resnet50,
}


def _call(model: Any, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _timed(step: Callable[[], Any], steps: int, warmup: int = 0) -> list[float]:
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _paired(rank: int, name: str, pipeline_step: Callable[[], Any], rounds: int, steps: int,
            compiled: bool = False) -> dict[str, Any]:
    """Alternate pipelined steps (all ranks) with plain single-process steps (rank 0, the other
    ranks idle in a barrier), round after round, so both see the same machine conditions; this
    machine's speed drifts by 20% or more between minutes. ``compiled``: the single process
    runs the model through ``torch.compile`` (its first step, which compiles, is timed apart)."""
    model, inputs, loss_fn, target = MODELS[name]()
    if compiled:
        model.compile()

    def single_step() -> None:
        loss_fn(_call(model, inputs), target).backward()
        model.zero_grad()

    first_ms = _timed(pipeline_step, 1)[0]  # warm-up (compiles, with compiled stages)
    _timed(pipeline_step, 1)
    single_first_ms = None
    torch.distributed.barrier()
    if rank == 0:
        single_first_ms = _timed(single_step, 1)[0]
        _timed(single_step, 1)
    pipe_ms: list[float] = []
    single_ms: list[float] = []
    for _ in range(rounds):
        torch.distributed.barrier()
        pipe_ms += _timed(pipeline_step, steps)
        torch.distributed.barrier()
        if rank == 0:
            single_ms += _timed(single_step, steps)
    torch.distributed.barrier()
    return {"ms": statistics.median(pipe_ms) if pipe_ms else None,
            "single_ms": statistics.median(single_ms) if single_ms else None,
            "first_ms": first_ms, "single_first_ms": single_first_ms}


def _pipecut_rank(rank: int, world: int, name: str, schedule: str, rounds: int, steps: int,
                  plan: str | None = None) -> dict[str, Any]:
    model, inputs, loss_fn, target = MODELS[name]()
    recompute = schedule.endswith("+recompute")
    compiled = schedule.endswith("+compiled")
    start = time.perf_counter()
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target,
        microbatches=MICROBATCHES, plan=plan,
        schedule=schedule.removesuffix("+recompute").removesuffix("+compiled"),
        runtime=pipecut.RuntimeOptions(timeout=300, compile_stages=compiled),
    )
    build_s = time.perf_counter() - start  # capture, plan, calibrate (compiling, if compiled)
    if recompute:  # the same split with every stage recomputing its forward in backward
        plan = with_recompute(pipe.plan)
        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target,
            microbatches=MICROBATCHES, plan=plan, runtime=pipecut.RuntimeOptions(timeout=300),
        )

    def step() -> None:
        pipe.step(inputs, target)
        for module in pipe.modules:  # ZBV: two stages per rank
            module.zero_grad()

    out = _paired(rank, name, step, rounds, steps, compiled=compiled)
    if rounds == 0:  # compile time only (the warm-cache run)
        return {**out, "build_s": build_s, "compile": [dataclasses.asdict(c) for c in pipe.compile_stats]}
    pipe.step(inputs, target, record=True)
    pipe.trace()
    plan = pipe.plan
    first = plan.node(plan.stages[1].nodes[0])
    return {**out, "build_s": build_s, "compile": [dataclasses.asdict(c) for c in pipe.compile_stats],
            "plan": plan.to_json(), "predicted_ms": plan.predicted.step_ms,
            "bubble": plan.predicted.bubble_fraction, "peak_activation_bytes": pipe.peak_activation_bytes,
            "capture": plan.capture.value, "cut_module": first.module,
            "stage_nodes": [len(s.nodes) for s in plan.stages],
            "timeline": _timeline_summary(pipe.timeline, plan, rank)}


def with_recompute(plan: pipecut.Plan, kinds: list[pipecut.Recompute] | None = None) -> pipecut.Plan:
    """``plan``'s split with stage s recomputing as ``kinds[s]`` says (default: every stage
    whole), stage costs and prediction rebuilt (a plan whose stages only say ``recompute``
    would still predict the step without it). A stage left SELECTIVE keeps its blocks."""
    kinds = kinds or [pipecut.Recompute.FULL] * len(plan.stages)
    live = liveness(plan.nodes)
    index = {u: i for i, u in enumerate(live.units)}
    bounds = [min(index[n] for n in st.nodes if n in index) for st in plan.stages] + [len(live.units)]
    facts = build_stages(plan.nodes, live, bounds, devices=plan.devices, link=plan.link,
                         schedule=plan.schedule, microbatches=plan.microbatches, recompute=kinds,
                         recomputed=[st.recomputed if k is pipecut.Recompute.SELECTIVE else ()
                                     for st, k in zip(plan.stages, kinds)])
    assert [st.nodes for st in facts.stages] == [st.nodes for st in plan.stages]
    return dataclasses.replace(plan, stages=facts.stages, edges=facts.edges, predicted=facts.predicted)


def _timeline_summary(events: Any, plan: pipecut.Plan, rank: int) -> dict[str, Any]:
    """This rank's recorded step against the plan: per microbatch, the median measured time of
    each action kind (F, B, or zero-bubble's I + W), summed over the rank's stages, beside their
    predicted forward and backward, and how much of the step the rank computed (the rest is
    waiting and messaging)."""
    spans: dict[tuple[int, str], list[float]] = {}
    for e in events:
        m = re.fullmatch(r"(\d+)([FBIW])(\d+)", e.action)
        if m:
            spans.setdefault((int(m.group(1)), m.group(2)), []).append((e.end - e.start) * 1e3)
    step_ms = max((e.end for e in events), default=0.0) * 1e3
    busy_ms = sum(sum(v) for v in spans.values())
    mine = plan.stages_on(rank)
    measured_f = sum(statistics.median(v) for (_, k), v in spans.items() if k == "F")
    measured_b = sum(statistics.median(v) for (_, k), v in spans.items() if k in "BIW")
    return {
        "rank": rank, "stages": list(mine), "recorded_step_ms": step_ms, "busy_ms": busy_ms,
        "forward_ms": measured_f or None, "backward_ms": measured_b or None,
        "predicted_forward_ms": sum(plan.stages[s].forward_ms for s in mine),
        "predicted_backward_ms": sum(plan.stages[s].backward_ms for s in mine),
    }


def _split_point(module_path: str, model: torch.nn.Module) -> str:
    """The outermost module boundary at or above ``module_path`` that is a child of a ModuleList
    or Sequential (where torch.distributed.pipelining can split); not the container's first
    child, which would leave the first stage empty (pipecut may cut inside it)."""
    parts = module_path.split(".")
    for i in range(1, len(parts) + 1):
        parent = model.get_submodule(".".join(parts[: i - 1])) if i > 1 else model
        if isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)):
            index = max(int(parts[i - 1]), 1) if parts[i - 1].isdigit() else parts[i - 1]
            return ".".join([*parts[: i - 1], str(index)])
    return module_path


def pippy_gpipe(model: torch.nn.Module, inputs: Any, splits: list[str], rank: int,
                microbatches: int, loss_fn: Any) -> tuple[Any, Callable[[Any, Any], None]]:
    """torch.distributed.pipelining as its users run it: ``pipeline()`` traces the whole
    ``model`` on one microbatch and splits it at the module ``splits``, this rank builds its
    stage on the CPU and trains it under ScheduleGPipe. Returns the stage and a step function
    ``step(inputs, target)``."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    args, kwargs = ((), {k: v.chunk(microbatches)[0] for k, v in inputs.items()}) if isinstance(inputs, dict) \
        else (tuple(x.chunk(microbatches)[0] for x in inputs), {})
    pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs,
                    split_spec={name: SplitPoint.BEGINNING for name in splits})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    sched = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=loss_fn)

    def step(inputs: Any, target: Any) -> None:
        if rank == 0:
            if isinstance(inputs, dict):
                sched.step(**inputs)
            else:
                sched.step(*inputs)
        elif rank == stage.num_stages - 1:
            sched.step(target=target, losses=[])
        else:
            sched.step()

    return stage, step


def _pippy_rank(rank: int, world: int, name: str, split: str, rounds: int, steps: int,
                compiled: bool = False) -> dict[str, Any]:
    model, inputs, loss_fn, target = MODELS[name]()
    stage, pippy_step = pippy_gpipe(model, inputs, [split], rank, MICROBATCHES, loss_fn)
    if compiled:  # as its users compile: the stage module, in place
        stage.submod.compile()

    def step() -> None:
        pippy_step(inputs, target)
        stage.submod.zero_grad()

    return _paired(rank, name, step, rounds, steps, compiled=compiled)


def run(names: list[str], rounds: int, steps: int,
        schedules: tuple[str, ...] = ("gpipe", "1f1b", "zero-bubble", "zbv"),
        pippy: bool = True, pippy_compiled: bool = False) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        cut_module = ""
        for schedule in (*schedules, *(("gpipe+recompute",) if name == "gpt" and "gpipe" in schedules else ())):
            res = run_ranks(_pipecut_rank, WORLD, name, schedule, rounds, steps, timeout=1800,
                            collective_timeout=600)
            r0 = res[0]
            if not cut_module or schedule == "gpipe":  # torch.distributed.pipelining runs GPipe
                cut_module = r0["cut_module"]
            rows.append({
                "model": name, "runner": f"pipecut {schedule}", "ms": r0["ms"],
                "single_ms": r0["single_ms"], "speedup": r0["single_ms"] / r0["ms"],
                "predicted_ms": r0["predicted_ms"],
                "prediction_error": (r0["predicted_ms"] - r0["ms"]) / r0["ms"], "bubble": r0["bubble"],
                "peak_activation_mib": [round(r["peak_activation_bytes"] / 2**20, 1) for r in res],
                "capture": r0["capture"], "stage_nodes": r0["stage_nodes"],
                "timeline": [r["timeline"] for r in res],
                **(_compile_times(res, run_ranks(_pipecut_rank, WORLD, name, schedule, 0, steps, r0["plan"],
                                                 timeout=1800, collective_timeout=600))
                   if schedule.endswith("+compiled") else {}),
            })
        if not pippy:
            print_table([r for r in rows if r["model"] == name])
            continue
        model = MODELS[name]()[0]
        split = _split_point(cut_module, model) if cut_module else ""
        for compiled in (False, True) if pippy_compiled else (False,):
            runner = f"torch.distributed.pipelining gpipe{'+compiled' if compiled else ''} (split {split})"
            try:
                res = run_ranks(_pippy_rank, WORLD, name, split, rounds, steps, compiled, timeout=1800,
                                collective_timeout=600)
                r0 = res[0]
                rows.append({"model": name, "runner": runner, "ms": r0["ms"], "single_ms": r0["single_ms"],
                             "speedup": r0["single_ms"] / r0["ms"],
                             **({"first_step_s": max(r["first_ms"] for r in res) / 1e3,
                                 "single_first_step_s": r0["single_first_ms"] / 1e3} if compiled else {})})
            except Exception as e:  # recorded, not hidden
                rows.append({"model": name, "runner": runner, "error": str(e).strip().splitlines()[-1][:200]})
        print_table([r for r in rows if r["model"] == name])
    return rows


def _compile_times(cold: list[dict[str, Any]], warm: list[dict[str, Any]]) -> dict[str, Any]:
    """Compile times of a compiled runner: its first run with an empty inductor cache, then a
    second run on the cache the first filled (shared by both ranks and the single process).
    ``compile_s``: the slowest rank's seconds in its calls that compiled (all its graphs);
    ``build_s``: the slowest rank's ``pipecut.compile`` (capture, plan, calibration steps,
    which compile; the warm run replays the cold run's plan, so it neither plans nor
    calibrates and compiles in its first step); ``first_step_s``: the slowest rank's first
    step after ``compile``; ``single_first_step_s``: the compiled single process's first step."""
    def times(res: list[dict[str, Any]]) -> dict[str, Any]:
        return {"compile_s": max(sum(c["seconds"] for c in r["compile"]) for r in res),
                "graphs": [sum(c["graphs"] for c in r["compile"]) for r in res],
                "cache_hits": [sum(c["cache_hits"] for c in r["compile"]) for r in res],
                "build_s": max(r["build_s"] for r in res),
                "first_step_s": max(r["first_ms"] for r in res) / 1e3,
                "single_first_step_s": res[0]["single_first_ms"] / 1e3}
    return {"compile_cold": times(cold), "compile_warm": times(warm)}


def print_table(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if "error" in r:
            print(f"{r['model']:8} {r['runner']:58} failed: {r['error']}")
            continue
        extra = ""
        if "predicted_ms" in r:
            extra = (f"  predicted {r['predicted_ms']:7.1f} ms ({r['prediction_error']:+.0%})  bubble "
                     f"{r['bubble']:.0%}  activations MiB {r['peak_activation_mib']}")
        if "compile_cold" in r:
            c, w = r["compile_cold"], r["compile_warm"]
            extra += (f"  compile cold {c['compile_s']:.0f} s (build {c['build_s']:.0f} s, one process "
                      f"{c['single_first_step_s']:.0f} s), warm {w['compile_s']:.0f} s (build + first "
                      f"step {w['build_s'] + w['first_step_s']:.0f} s, one process {w['single_first_step_s']:.0f} s)")
        elif "first_step_s" in r:
            extra += f"  first step {r['first_step_s']:.0f} s (one process {r['single_first_step_s']:.0f} s)"
        print(f"{r['model']:8} {r['runner']:58} {r['ms']:8.1f} ms  one process {r['single_ms']:8.1f} ms  "
              f"{r['speedup']:5.2f}x{extra}", flush=True)


def print_predictions(rows: list[dict[str, Any]]) -> None:
    """Predicted against measured step per runner, and per rank where the time goes: the
    per-microbatch forward and backward of its stages measured in the recorded step's timeline
    against the plan's, and the share of the recorded step each rank spent computing."""
    print(f"\n{'model':8} {'runner':28} {'predicted':>9} {'measured':>9} {'error':>6}  per rank (stages): "
          f"F measured/predicted, B measured/predicted (ms per microbatch), busy share of recorded step")
    for r in rows:
        if "predicted_ms" not in r:
            continue
        stages = "  ".join(
            f"r{t['rank']} (s{'+'.join(map(str, t['stages']))}): F {t['forward_ms'] or 0:.1f}/{t['predicted_forward_ms']:.1f} "
            f"B {t['backward_ms'] or 0:.1f}/{t['predicted_backward_ms']:.1f} "
            f"busy {t['busy_ms'] / t['recorded_step_ms']:.0%}"
            for t in r["timeline"]
        )
        flag = "  >10%" if abs(r["prediction_error"]) > 0.10 else ""
        print(f"{r['model']:8} {r['runner']:28} {r['predicted_ms']:8.1f}  {r['ms']:8.1f}  "
              f"{r['prediction_error']:+6.1%}  {stages}{flag}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per round and runner")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--schedules", default="gpipe,1f1b,zero-bubble,zbv",
                        help="pipecut schedules to run (the GPT example also runs gpipe+recompute)")
    parser.add_argument("--no-pippy", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument("--compiled", action="store_true",
                        help="torch.distributed.pipelining with compiled stage modules too; name "
                             "pipecut's compiled runs as schedules, e.g. 1f1b,1f1b+compiled")
    parser.add_argument("--out", default=str(Path(__file__).with_name("runtime.json")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Compiled runners start cold: an empty inductor cache, shared by the ranks and the single
    # process (each runner's second, compile-only run then reads it warm).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pipecut-inductor-")
    rows = run(args.models.split(","), args.rounds, args.steps, tuple(args.schedules.split(",")),
               not args.no_pippy, args.compiled)
    print_predictions(rows)
    Path(args.out).write_text(json.dumps({"batch": BATCH, "microbatches": MICROBATCHES, "ranks": WORLD,
                                          "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
