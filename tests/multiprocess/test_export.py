"""Weights out: ``pipe.save_pretrained(dir)`` writes Hugging Face shards + index that
``from_pretrained``, ``load_state_dict`` and ``compile(..., weights=dir)`` read back.

Scenarios, in two forked runs:
- K = 2 (GPT-2 with its tied embeddings, Llama; GPT-2 again with two stages per rank): one SGD
  step so that the weights written are the trained ones, ``save_pretrained`` (GPT-2 given the
  model, Llama not: config.json comes from the model compiled either way), then a meta model
  compiled from the directory, whose state dict must be the saved pipeline's; a rank whose
  shard write fails makes every rank raise (naming it) and leaves no index; a directory
  holding a pipecut checkpoint is refused.
- 2 × 2 on 4 ranks (DDP and FSDP2): one SGD step, ``save_pretrained``: replica 0 writes two
  shards, one copy of every tensor, FSDP's shards gathered whole.

Values are compared bitwise (rtol=0, atol=0): they are copied, never recomputed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import pipecut
from pipecut.runtime.state import checkpoint as ckpt
from pipecut.runtime.state import export as export_module
from tests import families
from tests.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

EXACT: dict[str, Any] = {"rtol": 0, "atol": 0}
M = 4


def _trained(pipe: Any, inputs: Any, target: Any) -> dict[str, torch.Tensor]:
    """One SGD step (so saved values differ from the initial ones); this rank's state dict,
    FSDP's shards gathered whole."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.step(inputs, target)
    opt.step()
    opt.zero_grad()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in pipe.state_dict().items()}


def _two_stages(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("gpt2", "llama"):
        # Eager attention, not transformers' default: the meta model below replays the real
        # model's plan, and under SDPA a meta capture is not the CPU one (docs/big-models.md).
        model, inputs, loss_fn, target = families.FAMILIES[name](batch_size=8, seed=0, attention="eager")
        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
            runtime=pipecut.RuntimeOptions(timeout=60),
            measure=pipecut.MeasureOptions(calibration_steps=0),
        )
        state = _trained(pipe, inputs, target)
        # config.json: from the model compiled; the model given adds its class as architectures.
        written = pipe.save_pretrained(f"{root}/{name}", model if name == "gpt2" else None)
        meta, *_ = families.on_meta(name, attention="eager")
        again = pipecut.compile(
            meta, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
            weights=f"{root}/{name}", plan=pipe.plan, runtime=pipecut.RuntimeOptions(timeout=60),
        )
        out[name] = {"state": state, "written": str(written), "reloaded": again.state_dict(),
                     "architectures": model.config.architectures}
        if name == "gpt2":
            out["failed"] = _failing_write(rank, pipe, f"{root}/failed")
            ckpt.save(pipe, f"{root}/checkpoint")
            try:
                pipe.save_pretrained(f"{root}/checkpoint")
                out["checkpoint"] = "no error"
            except Exception as e:
                out["checkpoint"] = f"{type(e).__name__}: {e}"
    model, inputs, loss_fn, target = families.FAMILIES["gpt2"](batch_size=8, seed=0)
    pipe = pipecut.compile(
        model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
        schedule="interleaved-1f1b", runtime=pipecut.RuntimeOptions(timeout=60),
        measure=pipecut.MeasureOptions(calibration_steps=0),
        scheduling=pipecut.ScheduleOptions(stages_per_rank=2),
    )
    out["interleaved"] = {"state": _trained(pipe, inputs, target), "stages": pipe.stages}
    pipe.save_pretrained(f"{root}/interleaved", model)
    return out


def _failing_write(rank: int, pipe: Any, where: str) -> str:
    real = export_module._write_shard

    def broken(directory, name, tensors):
        real(directory, name, tensors)  # the shard lands, then the rank fails
        raise OSError("disk full")

    export_module._write_shard = broken if rank == 1 else real
    try:
        pipe.save_pretrained(where)
        return "no error"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        export_module._write_shard = real


def _replicas(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    half = slice(8 * replica, 8 * replica + 8)
    out: dict[str, Any] = {"replica": replica, "wrote": []}
    real = export_module._write_shard

    def counted(directory, name, tensors):
        out["wrote"].append(name)
        real(directory, name, tensors)

    export_module._write_shard = counted
    for kind in ("ddp", "fsdp"):
        model, inputs, loss_fn, target = families.FAMILIES["gpt2"](batch_size=16, seed=0)
        mine, mine_target = {"input_ids": inputs["input_ids"][half]}, target[half]
        pipe = pipecut.compile(
            model, mine, mesh, loss_fn=loss_fn, target=mine_target, microbatches=M,
            data_parallel=kind, runtime=pipecut.RuntimeOptions(timeout=60),
            measure=pipecut.MeasureOptions(calibration_steps=0),
        )
        state = _trained(pipe, mine, mine_target)
        pipe.save_pretrained(f"{root}/{kind}", model)
        out[kind] = state
        out[f"{kind} sharded"] = any(isinstance(p, DTensor) for p in pipe.parameters())
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    stale = root / "llama"  # an earlier save's files: from_pretrained would read model.safetensors
    stale.mkdir()
    for name in ("model.safetensors", "model-00003-of-00003.safetensors"):
        save_file({"old": torch.zeros(1)}, stale / name)
    (stale / "README.md").write_text("kept")
    return root, run_ranks(_two_stages, 2, str(root), timeout=380)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-dp")
    return root, run_ranks(_replicas, 4, str(root), timeout=380)


def _files(path: Path, count: int = 2) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's ``count`` shards, checking the index against them."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == count, shards
    assert sorted(p.name for p in path.glob("*.safetensors")) == shards
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        assert re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", shard), shard
        with safe_open(str(path / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        part = load_file(path / shard)
        assert not set(part) & set(out), "a tensor written twice"
        assert all(index["weight_map"][k] == shard for k in part)
        out.update(part)
    assert sorted(out) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def _merged(ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for state in ranks:
        for k, v in state.items():
            if k in merged:  # a tied weight on two stages: equal after the step
                torch.testing.assert_close(v, merged[k], **EXACT)
            merged[k] = v
    return merged


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_two_stages_write_what_hf_reads_back(two, name):
    root, ranks = two
    path = root / name
    assert all(r[name]["written"] == str(path) for r in ranks)
    state = _merged([r[name]["state"] for r in ranks])
    files = _files(path)  # the stale shards are gone (only the index's are left)
    assert name != "llama" or (path / "README.md").read_text() == "kept"
    # The keys save_pretrained of the plain model writes: GPT-2's tied head once, as wte.
    plain = families.FAMILIES[name](batch_size=8, seed=0)[0]
    plain.save_pretrained(root / f"hf-{name}")
    assert sorted(files) == sorted(load_file(root / f"hf-{name}" / "model.safetensors"))
    for key, value in files.items():
        torch.testing.assert_close(value, state[key], **EXACT)
    assert all(r[name]["architectures"] is None for r in ranks), "save_pretrained changed the user's config"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == plain.config.model_type
    assert config.get("architectures") == (["GPT2LMHeadModel"] if name == "gpt2" else None)
    loaded = families.from_pretrained(str(path))
    assert type(loaded) is type(plain)
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, state[key], **EXACT)
    fresh = families.FAMILIES[name](batch_size=8, seed=1)[0]
    result = fresh.load_state_dict(files, strict=name != "gpt2")
    # A tied alias is in no file (as with save_pretrained's own files): strict loading names it.
    assert list(result.missing_keys) == (["lm_head.weight"] if name == "gpt2" else [])
    assert fresh.lm_head.weight is (fresh.transformer.wte.weight if name == "gpt2" else fresh.lm_head.weight)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, state[key], **EXACT)
    # compile(meta, weights=dir) on every rank: the saved pipeline's tensors again.
    reloaded = _merged([r[name]["reloaded"] for r in ranks])
    assert sorted(reloaded) == sorted(state)
    for key, value in reloaded.items():
        torch.testing.assert_close(value, state[key], **EXACT)


def test_a_rank_with_two_stages_writes_one_shard(two):
    root, ranks = two
    assert [r["interleaved"]["stages"] for r in ranks] == [(0, 2), (1, 3)]
    state = _merged([r["interleaved"]["state"] for r in ranks])
    files = _files(root / "interleaved")
    assert sorted(state) == sorted([*files, "lm_head.weight"])
    for key, value in families.from_pretrained(str(root / "interleaved")).state_dict().items():
        torch.testing.assert_close(value, state[key], **EXACT)


def test_a_failed_shard_write_fails_every_rank_and_leaves_no_index(two):
    root, ranks = two
    assert ranks[1]["failed"] == "OSError: disk full"
    assert re.fullmatch(r"PipelineRuntimeError: rank 0 stopped because rank 1 failed to write its "
                        r"shard into .*failed: OSError: disk full", ranks[0]["failed"]), ranks[0]["failed"]
    assert not (root / "failed" / "model.safetensors.index.json").exists()
    assert not list((root / "failed").glob(".*tmp*"))


def test_a_directory_holding_a_pipecut_checkpoint_is_refused(two):
    _, ranks = two
    for r in ranks:
        assert re.match(r"InputError: save_pretrained: .*checkpoint holds a pipecut checkpoint "
                        r"\(\.metadata\).*another directory", r["checkpoint"]), r["checkpoint"]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_replicas_write_one_copy(replicas, kind):
    root, ranks = replicas
    assert sorted(r["replica"] for r in ranks) == [0, 0, 1, 1]
    assert all(r[f"{kind} sharded"] == (kind == "fsdp") for r in ranks)  # FSDP: gathered to write
    wrote = sorted(name for r in ranks if r["replica"] == 0 for name in r["wrote"])
    assert wrote == sorted(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] * 2)
    assert all(not r["wrote"] for r in ranks if r["replica"] == 1), "replica 1 wrote a shard"
    files = _files(root / kind)
    for replica in (0, 1):  # replicas hold equal weights after the step; replica 0 wrote them
        state = _merged([r[kind] for r in ranks if r["replica"] == replica])
        assert sorted(state) == sorted([*files, "lm_head.weight"])
        for key, value in files.items():
            torch.testing.assert_close(value, state[key], **EXACT)
    loaded = families.from_pretrained(str(root / kind))
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, files.get(key, files["transformer.wte.weight"]), **EXACT)
