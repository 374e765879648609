"""A short check of pipecut on whatever CUDA devices exist: ``make gpu-check``.

Without CUDA it says so and exits 0 (nothing to check). With one GPU: profiling on CUDA gives
a finite, positive time for the graph (profiling times each node's kernels with CUDA events,
:class:`pipecut.core.clock.Timer`; the node sum is printed beside the whole forward timed by CUDA
events, for information: a small model's whole forward is bound by the host's dispatch, which
the node times leave out), a K=1 step with 4 microbatches and an autocast
bf16 step both match the plain model. With two or more: parity on NCCL at K=2 (and K=4 with
four GPUs) for the three examples and a transformers GPT-2, data parallel × pipeline (DDP and
FSDP, 2 × 2) with four GPUs, and the GPT step time against one GPU (reported, not asserted).

Each check runs in fresh processes (``torch.multiprocessing.spawn``, NCCL, a free port), one
per GPU; results come back through files. Exit status 1 if any check fails.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pipecut
from pipecut.core.torch_private import pytree

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# pipecut and the examples are imported where used, so that the check without CUDA is quick.

# fp32 on GPU: kernels chosen per shape (a microbatch and the whole batch take different cuBLAS
# and cuDNN algorithms, with different reduction splits) and atomics in embedding backward
# reorder sums, ~1e-6 relative; 1e-4 keeps a wide margin and still catches a missing term.
RTOL, ATOL = 1e-4, 1e-5
# bf16 autocast: 8 mantissa bits (eps 7.8e-3); per-microbatch and whole-batch products round
# differently, so results differ by a few eps; a missing or doubled term is still O(1).
BF16_RTOL, BF16_ATOL = 5e-2, 5e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 for parity (TF32 is 10 bits)
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        torch.save({"ok": fn(rank, world, *args)}, f"{out}/{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, f"{out}/{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes, one GPU each."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, _free_port(), tmp, fn, args), nprocs=world, join=True)
        results = [torch.load(f"{tmp}/{r}.pt", weights_only=False) for r in range(world)]
    errors = [f"--- rank {r} ---\n{x['error']}" for r, x in enumerate(results) if "error" in x]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [x["ok"] for x in results]


def hf_gpt2(batch_size: int = 8, seed: int = 0):
    """A small transformers GPT-2 (the one tests/multiprocess/test_parity.py uses)."""
    from tests.multiprocess.test_parity import hf_gpt2 as build

    return build(batch_size, seed)


def factories() -> dict[str, Callable[..., Any]]:
    from examples import EXAMPLES

    return {**EXAMPLES, "hf_gpt2": hf_gpt2}


def canonical_names(model: torch.nn.Module) -> dict[int, str]:
    from pipecut.core.graph import canonical_names as names

    return names(model)
PER_MICROBATCH = {"resnet"}  # BatchNorm: the reference runs microbatch by microbatch


def _to(value: Any, device: Any) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def reference(name: str, microbatches: int, device: Any, autocast: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the plain model on ``device`` (whole batch, or microbatch by
    microbatch for BatchNorm models)."""
    model, inputs, loss_fn, target = factories()[name]()
    model.to(device)
    inputs, target = _to(inputs, device), _to(target, device)
    names = canonical_names(model)
    chunks = microbatches if name in PER_MICROBATCH else 1
    parts = list(zip(_split(inputs, chunks), target.chunk(chunks)))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = sum(loss_fn(_call(model, x), t) for x, t in parts) / chunks
    loss.backward()
    grads = {names[id(p)]: p.grad.float().cpu() for p in model.parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _split(inputs: Any, chunks: int) -> list[Any]:
    if isinstance(inputs, dict):
        return [dict(zip(inputs, vals)) for vals in zip(*(v.chunk(chunks) for v in inputs.values()))]
    return [tuple(vals) for vals in zip(*(v.chunk(chunks) for v in inputs))]


def _pipe_result(model: torch.nn.Module, pipe: Any, loss: torch.Tensor) -> dict[str, Any]:
    names = canonical_names(model)
    grads = {names[id(p)]: p.grad.float().cpu() for p in pipe.parameters() if p.grad is not None}
    return {"loss": float(loss), "grads": grads}


def _parity(rank: int, world: int, names: list[str], microbatches: int, autocast: bool) -> list[dict[str, Any]]:
    device = torch.device("cuda", rank)
    out = []
    for name in names:
        model, inputs, loss_fn, target = factories()[name]()
        model.to(device)
        inputs, target = _to(inputs, device), _to(target, device)

        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target,
            microbatches=microbatches, schedule="1f1b", runtime=pipecut.RuntimeOptions(timeout=120),
        )
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = pipe.step(inputs, target)
        out.append(_pipe_result(model, pipe, loss))
    return out


def _hybrid(rank: int, world: int, kinds: list[str]) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    device = torch.device("cuda", rank)
    out = []
    for kind in kinds:
        model, inputs, loss_fn, target = factories()["gpt"]()
        first = canonical_names(model)
        alias = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        model.to(device)
        half = slice(8 * replica, 8 * replica + 8)
        x, t = (inputs[0][half].to(device),), target[half].to(device)

        pipe = pipecut.compile(
            model, x, mesh, loss_fn=loss_fn, target=t, microbatches=4,
            schedule="1f1b", data_parallel=kind, runtime=pipecut.RuntimeOptions(timeout=120),
        )
        loss = pipe.step(x, t)
        grads = {}
        for n, p in pipe.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[alias[n]] = g.float().cpu()
        out.append({"loss": float(loss), "grads": grads})
    return out


def _step_ms(rank: int, world: int, steps: int) -> float:
    from examples.gpt import build_demo

    device = torch.device("cuda", rank)
    model, inputs, loss_fn, target = build_demo(batch_size=32)
    model.to(device)
    inputs, target = _to(inputs, device), _to(target, device)

    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=8,
        schedule="1f1b", runtime=pipecut.RuntimeOptions(timeout=120),
    )
    times = []
    for _ in range(steps + 2):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        pipe.step(inputs, target)
        torch.cuda.synchronize()
        dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def _plain_step_ms(steps: int) -> float:
    from examples.gpt import build_demo

    model, inputs, loss_fn, target = build_demo(batch_size=32)
    model.cuda()
    inputs, target = _to(inputs, "cuda"), _to(target, "cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps + 2):
        start.record()
        loss_fn(model(*inputs), target).backward()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def _compare(what: str, ref: tuple[float, dict[str, torch.Tensor]], got: list[dict[str, Any]],
             rtol: float = RTOL, atol: float = ATOL) -> None:
    ref_loss, ref_grads = ref
    merged: dict[str, torch.Tensor] = {}
    for r, res in enumerate(got):
        torch.testing.assert_close(res["loss"], ref_loss, rtol=rtol, atol=atol, msg=f"{what}: rank {r} loss")
        merged.update(res["grads"])
    missing = sorted(set(ref_grads) - set(merged))
    assert not missing, f"{what}: no rank returned gradients for {missing}"
    for name, g in ref_grads.items():
        torch.testing.assert_close(merged[name], g, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what}: {n}: {m}")


def _profile_check() -> str:
    model, inputs, loss_fn, target = factories()["gpt"]()
    model.cuda()
    inputs, target = _to(inputs, "cuda"), _to(target, "cuda")

    plan = pipecut.plan(model, inputs, devices=1, loss_fn=loss_fn, target=target, microbatches=4)
    times = [n.forward_ms + n.backward_ms for n in plan.nodes]
    assert all(t >= 0 and t == t and t < float("inf") for t in times), "a node time is negative or not finite"
    assert sum(times) > 0, "profiling on CUDA measured nothing"
    assert plan.devices[0].name == "cuda", plan.devices
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    mb = (inputs[0][:4],)
    with torch.no_grad():
        for _ in range(3):
            model(*mb)
        start.record()
        model(*mb)
        end.record()
    end.synchronize()
    node_fwd = sum(n.forward_ms for n in plan.nodes)
    # A model left on the CPU is measured on the GPU its stages will run on, a node at a time.
    cpu_model, cpu_inputs, _, cpu_target = factories()["gpt"]()
    elsewhere = pipecut.plan(
        cpu_model, cpu_inputs, devices=1, loss_fn=loss_fn, target=cpu_target, microbatches=4,
        measure=pipecut.MeasureOptions(device="cuda"),
    )
    assert elsewhere.profiled_on.startswith("cuda"), elsewhere.profiled_on
    assert all(p.device.type == "cpu" for p in cpu_model.parameters()), "planning moved the model"
    there = sum(n.forward_ms for n in elsewhere.nodes)
    return (f"node forwards sum to {node_fwd:.3f} ms; the whole forward takes "
            f"{start.elapsed_time(end):.3f} ms (CUDA events); a CPU model profiled on "
            f"{elsewhere.profiled_on}: {there:.3f} ms")


def main() -> int:
    if not torch.cuda.is_available():
        why = ("this torch is a CPU build; run with a CUDA build, e.g. make gpu-check VENV=<venv "
               "with CUDA torch>" if torch.version.cuda is None else "no CUDA device is visible")
        print(f"gpu-check: skipped: {why} (torch {torch.__version__}); nothing to check here")
        return 0
    n = torch.cuda.device_count()
    have_hf = _importable("transformers")
    print(f"gpu-check: {n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    checks: list[tuple[str, Callable[[], str | None]]] = [
        ("profile on CUDA", _profile_check),
        ("K=1, 4 microbatches, gpt", lambda: _compare("K=1", reference("gpt", 4, "cuda:0"),
                                                      run(1, _parity, ["gpt"], 4, False)[0][:1]) or None),
        ("K=1, autocast bf16, gpt", lambda: _compare(
            "bf16", reference("gpt", 4, "cuda:0", autocast=True), run(1, _parity, ["gpt"], 4, True)[0][:1],
            BF16_RTOL, BF16_ATOL) or None),
    ]
    names = ["mlp", "gpt", "resnet"] + (["hf_gpt2"] if have_hf else [])
    for k in (2, 4):
        if k <= n:
            checks.append((f"parity K={k} on NCCL: {', '.join(names)}", _multi(k, names)))
    if n >= 4:
        checks.append(("data parallel 2 x 2 (DDP, FSDP) on NCCL, gpt", _hybrid_check))
    if n >= 2:
        checks.append(("GPT step time, K=2 against one GPU", _timing))
    failed = 0
    for what, check in checks:
        try:
            note = check()
            print(f"  ok    {what}" + (f": {note}" if note else ""))
        except Exception as e:
            failed += 1
            print(f"  FAIL  {what}: {type(e).__name__}: {e}")
    if not have_hf:
        print("  note  transformers is not installed: the GPT-2 parity check was left out")
    print(f"gpu-check: {len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _multi(k: int, names: list[str]) -> Callable[[], None]:
    def check() -> None:
        per_rank = run(k, _parity, names, 4, False)
        for i, name in enumerate(names):
            _compare(f"{name} K={k}", reference(name, 4, "cuda:0"), [r[i] for r in per_rank])

    return check


def _hybrid_check() -> None:
    kinds = ["ddp", "fsdp"]
    per_rank = run(4, _hybrid, kinds)
    ref = reference("gpt", 4, "cuda:0")
    for i, kind in enumerate(kinds):
        _compare(f"gpt {kind} 2 x 2", ref, [r[i] for r in per_rank])


def _timing() -> str:
    pipelined = run(2, _step_ms, 5)[0]
    plain = _plain_step_ms(5)
    return f"pipelined on 2 GPUs {pipelined:.1f} ms, plain model on 1 GPU {plain:.1f} ms per step"


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())

