"""Models built on the meta device: each rank materialises only its stage and fills it from
weights (a safetensors file, a save_pretrained directory) or initialises it, with the plain
model's numbers.

Scenarios, all in one forked run at K=2 (GPT-2 alone again at K=4):
- the zoo GPT-2 (torch.export; tied embeddings, stored once by save_pretrained) built on meta
  and compiled with ``weights=<save_pretrained dir>``, against the plain GPT-2 the directory was
  saved from;
- an MLP (symbolic_trace) built on meta with ``weights=<file>.safetensors``, against the plain
  MLP;
- the same meta MLP without weights: stages initialised by ``reset_parameters`` under per-module
  seeds, which must equal ``materialize_model`` (the whole model initialised the same way) and
  train like it;
- on every rank: the user's model stays on meta, and the real tensors a rank holds are its
  stage's only (counted in bytes), never the whole model.

Tolerances: as tests/multiprocess/test_zoo.py (the pipeline runs the captured graph, the reference the
eager modules; measured differences are ~1e-7): atol=1e-5, rtol=1e-4.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

import pipecut
from examples import mlp, zoo
from pipecut.core.meta import is_meta, module_tensors
from pipecut.runtime.state import checkpoint as ckpt
from pipecut.runtime.state.materialize import materialize_model, raise_together
from tests.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

ATOL, RTOL = 1e-5, 1e-4
M = 4
WIDTH, DEPTH = 64, 6


def _gpt2_meta():
    from transformers import GPT2LMHeadModel

    plain, inputs, loss_fn, target = zoo.gpt2(batch_size=8, seed=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(plain.config)
    return model, inputs, loss_fn, target


def _mlp_meta():
    _, inputs, loss_fn, target = mlp.build(batch_size=8, seed=0, width=WIDTH, depth=DEPTH)
    with torch.device("meta"):
        model = mlp.MLP(WIDTH, DEPTH)
    return model, inputs, loss_fn, target


def _real_bytes(module: nn.Module) -> int:
    seen: dict[int, torch.Tensor] = {id(t): t for _, t in module_tensors(module) if not is_meta(t)}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _step(world, build, save=None, **kw):
    model, inputs, loss_fn, target = build()
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
        runtime=pipecut.RuntimeOptions(timeout=60), **kw,
    )
    if save is not None:
        ckpt.save(pipe, save)
    loss = pipe.step(inputs, target)
    stage_bytes = sum(t.numel() * t.element_size()
                      for t in {id(t): t for m in pipe.modules for _, t in module_tensors(m)}.values())
    return {
        "loss": loss,
        "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None},
        "buffers": {},
        "state": {n: t.clone() for n, t in pipe.state_dict().items()},
        "user_model_meta": all(is_meta(t) for _, t in module_tensors(model)),
        "held_bytes": _real_bytes(pipe.captured.gm),
        "stage_bytes": stage_bytes,
        "stages": [len(s.nodes) for s in pipe.plan.stages],
        "detail": pipe.plan.solver.detail,
        "capture": pipe.plan.capture.value,
        "cut_constants": zoo.cut_constants(pipe.plan),
    }


def _scenarios(rank, world, root):
    out = {
        "gpt2_dir": _step(world, _gpt2_meta, weights=f"{root}/gpt2"),
        "mlp_file": _step(world, _mlp_meta, weights=f"{root}/mlp.safetensors",
                          save=f"{root}/ckpt-{world}"),
        "mlp_init": _step(world, _mlp_meta, weights=pipecut.WeightOptions(seed=3)),
    }
    # A checkpoint saved by a meta-built pipeline is a weight source for another one.
    out["mlp_ckpt"] = _step(world, _mlp_meta, weights=f"{root}/ckpt-{world}")
    plain = mlp.build(batch_size=8, seed=0, width=WIDTH, depth=DEPTH)[0]
    try:  # the last stage's head.bias is missing: its rank says so, the others name that rank
        _step(world, _mlp_meta, weights={k: v for k, v in plain.state_dict().items() if k != "head.bias"})
        out["missing"] = "no error"
    except Exception as e:
        out["missing"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("weights")
    zoo.gpt2(batch_size=8, seed=0)[0].save_pretrained(path / "gpt2")
    model = mlp.build(batch_size=8, seed=0, width=WIDTH, depth=DEPTH)[0]
    save_file(model.state_dict(), path / "mlp.safetensors")
    return path


@pytest.fixture(scope="module")
def k2(root):
    return run_ranks(_scenarios, 2, str(root), timeout=300)


def _gpt2_only(rank, world, root):
    return {"gpt2_dir": _step(world, _gpt2_meta, weights=f"{root}/gpt2")}


@pytest.fixture(scope="module")
def k4(root):
    return run_ranks(_gpt2_only, 4, str(root), timeout=300)


def _reference(model, inputs, loss_fn, target):
    from pipecut.core.batching import split_microbatches

    total = torch.zeros(())
    for mb, t in zip(split_microbatches(inputs, M, 8), split_microbatches(target, M, 8, "target")):
        out = model(**mb) if isinstance(mb, dict) else model(*mb)
        loss = loss_fn(out, t) / M
        loss.backward()
        total += loss.detach()
    return total, model


def test_gpt2_meta_from_save_pretrained_dir_matches_plain(k2):
    plain, inputs, loss_fn, target = zoo.gpt2(batch_size=8, seed=0)
    report = zoo.compare(_reference(plain, inputs, loss_fn, target), [r["gpt2_dir"] for r in k2], ATOL, RTOL)
    assert len(report["stages"]) == 2 and all(report["stages"])


def test_gpt2_meta_at_four_stages_matches_plain(k4):
    plain, inputs, loss_fn, target = zoo.gpt2(batch_size=8, seed=0)
    report = zoo.compare(_reference(plain, inputs, loss_fn, target), [r["gpt2_dir"] for r in k4], ATOL, RTOL)
    assert len(report["stages"]) == 4 and all(report["stages"])
    for rank, r in enumerate(k4):
        assert r["gpt2_dir"]["held_bytes"] == r["gpt2_dir"]["stage_bytes"], rank


def test_mlp_meta_from_safetensors_file_matches_plain(k2):
    plain, inputs, loss_fn, target = mlp.build(batch_size=8, seed=0, width=WIDTH, depth=DEPTH)
    report = zoo.compare(_reference(plain, inputs, loss_fn, target), [r["mlp_file"] for r in k2], ATOL, RTOL)
    assert len(report["stages"]) == 2 and all(report["stages"])


def test_mlp_meta_from_a_pipecut_checkpoint_matches_plain(k2):
    plain, inputs, loss_fn, target = mlp.build(batch_size=8, seed=0, width=WIDTH, depth=DEPTH)
    report = zoo.compare(_reference(plain, inputs, loss_fn, target), [r["mlp_ckpt"] for r in k2], ATOL, RTOL)
    assert all(report["stages"])


def test_a_missing_tensor_fails_every_rank_naming_the_stage(k2):
    assert k2[1]["mlp_file"]["stages"] == k2[0]["mlp_file"]["stages"]
    last = r"stage 1 \(rank 1\): weights the state dict passed as weights lack 1 tensor.*'head.bias'"
    assert re.match(rf"InputError: {last}", k2[1]["missing"]), k2[1]["missing"]
    assert re.match(rf"PipelineRuntimeError: rank 0 stopped because rank 1 failed .*{last}", k2[0]["missing"]), k2[0]["missing"]


def test_meta_init_without_weights_equals_whole_model_init(k2):
    meta, inputs, loss_fn, target = _mlp_meta()
    whole = materialize_model(meta, seed=3)
    expected = whole.state_dict()
    got = {n: t for r in k2 for n, t in r["mlp_init"]["state"].items()}
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)  # same seeds: bitwise
    report = zoo.compare(_reference(whole, inputs, loss_fn, target), [r["mlp_init"] for r in k2], ATOL, RTOL)
    assert all(report["stages"])


def test_no_rank_holds_the_whole_model(k2):
    for name in ("gpt2_dir", "mlp_file", "mlp_init", "mlp_ckpt"):
        model = (_gpt2_meta if name == "gpt2_dir" else _mlp_meta)()[0]
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        for rank, r in enumerate(k2):
            res = r[name]
            assert res["user_model_meta"], f"{name}: compile changed the user's meta model"
            # Everything real on this rank (its whole captured graph) is its stage's tensors.
            assert res["held_bytes"] == res["stage_bytes"], (name, rank, res["held_bytes"], res["stage_bytes"])
            assert res["held_bytes"] < total, (name, rank, res["held_bytes"], total)
        assert "meta model" in k2[0][name]["detail"]


def _one_never_reports(rank, world):
    """Rank 1 never reports (stuck elsewhere, as a rank blocked in a collective of its own)."""
    if rank == 1:
        time.sleep(6)
        return "away"
    try:
        raise_together(None, "split its stage")
    except pipecut.PipecutError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(60)
def test_a_rank_that_never_reports_fails_the_others_clearly_at_the_groups_timeout():
    got = run_ranks(_one_never_reports, 2, timeout=50, collective_timeout=3)
    assert got[1] == "away"
    assert got[0].startswith("PipelineRuntimeError: rank 0 could split its stage, but not every rank reported"), got[0]
