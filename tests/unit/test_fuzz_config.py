"""The fuzzer's configuration space (tests/fuzz_config.py), without running anything."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples.architectures import ARCHITECTURES
from pipecut.errors import InputError, PipelineRuntimeError
from tests.fuzz_bugs import effective, known
from tests.fuzz_config import CHOOSE, FEATURES, Config, draw, problems, simpler, spread
from tests.fuzz_models import MODELS
from tests.fuzz_pool import is_refusal
from tests.fuzz_real import REAL
from tests.fuzz_run import Trail


def test_drawn_configurations_are_drawable_and_print_back() -> None:
    drawn = draw(150, seed=3, no_sync=True)
    assert len(drawn) > 100
    for cfg in drawn:
        assert problems(cfg) == [], cfg
        assert eval(cfg.short(), {"Config": Config}) == cfg  # benchmarks/fuzz.py --replay reads it
    assert len({c.model for c in drawn}) >= 5  # hypothesis clusters; spread() evens it out


def test_simpler_configurations_are_drawable_and_simpler() -> None:
    cfg = Config(model="tied_lm", ranks=4, microbatches=8, schedule="interleaved-1f1b", stages_per_rank=2,
                 split=("blocks.0", "blocks.0.mlp", "blocks.1", "blocks.1.mlp", "blocks.2", "blocks.3", "ln_f"),
                 autocast="fp16", accumulation=3, no_sync=True, eval_between=True, steps=3)
    assert problems(cfg) == []
    neighbours = list(simpler(cfg))
    assert neighbours and all(problems(n) == [] and n != cfg for n in neighbours)
    fewer = [n for n in neighbours if n.stages_per_rank == 1]
    assert fewer and all(len(n.split) == n.stages - 1 for n in fewer)  # the split follows the stages
    assert any(n.autocast == "off" for n in neighbours) and any(n.ranks == 2 for n in neighbours)


def test_problems_name_what_is_not_drawn() -> None:
    cfg = Config(model="bn_cnn", ranks=2, microbatches=2, schedule="zero-bubble", split=("layers.1",))
    assert problems(cfg) == []
    assert "data parallelism: 2 x 2 ranks, no BatchNorm" in problems(dataclasses.replace(cfg, data_parallel="ddp"))
    assert "split-backward schedules refuse recompute" in problems(dataclasses.replace(cfg, recompute="full"))
    assert "a pinned split has one point per later stage" in problems(dataclasses.replace(cfg, ranks=3))


def test_spread_covers_pairs_of_features() -> None:
    drawn = draw(200, seed=5, no_sync=True)
    chosen = spread(drawn, 30)
    assert len(chosen) == 30 and len(set(chosen)) == 30
    for feature in ("model", "schedule", "autocast", "data_parallel"):
        assert {getattr(c, feature) for c in chosen} == {getattr(c, feature) for c in drawn}, feature
    assert "model" in FEATURES


def test_new_dimensions_are_drawn_and_their_invalid_combinations_kept_out() -> None:
    drawn = draw(300, seed=7, no_sync=True)
    assert {c.dtype for c in drawn} == {"float32", "float64", "bfloat16"}
    assert {c.default_dtype for c in drawn} == {"float32", "float64"}
    assert any(c.freeze for c in drawn) and any(c.rows == 1 for c in drawn)
    assert {c.plan for c in drawn} >= {"auto", "split", "pinned"} and {c.choose for c in drawn} == set(CHOOSE)
    assert any(MODELS[c.model].real for c in drawn) and any(not MODELS[c.model].real for c in drawn)
    for cfg in drawn:
        assert cfg.default_dtype == "float32" or cfg.dtype == "float64", cfg
        assert cfg.autocast == "off" or cfg.dtype == "float32", cfg
        assert not cfg.freeze or (cfg.steps == 3 and cfg.freeze in MODELS[cfg.model].freezable), cfg
    cfg = Config(model="gpt2", ranks=2, microbatches=2, schedule="1f1b", split=("transformer.h.1",))
    assert problems(dataclasses.replace(cfg, dtype="bfloat16", autocast="bf16")) == [
        "autocast with float32 parameters only"]
    assert problems(dataclasses.replace(cfg, default_dtype="float64")) == [
        "a float64 default dtype builds float64 parameters"]
    assert problems(dataclasses.replace(cfg, freeze="transformer.wte.weight")) == [
        "freeze one of the model's freezable parameters, in a run of 3 steps"]
    assert problems(dataclasses.replace(cfg, freeze="transformer.wte.weight", steps=3)) == []
    assert problems(dataclasses.replace(cfg, plan="split", choose="both")) == []
    assert problems(dataclasses.replace(cfg, choose="both")) == ["choose matters only where compile plans"]


def test_shrinking_drops_the_new_dimensions() -> None:
    cfg = Config(model="skip", ranks=2, microbatches=2, schedule="1f1b", split=("layers.3",), dtype="float64",
                 default_dtype="float64", freeze="inp.weight", steps=3)
    neighbours = list(simpler(cfg))
    assert any(n.freeze == "" for n in neighbours) and any(n.default_dtype == "float32" for n in neighbours)
    assert all(problems(n) == [] for n in neighbours)
    assert not any(n.dtype == "float32" and n.default_dtype == "float64" for n in neighbours)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_models_have_the_split_points_and_parameters_they_name(name: str) -> None:
    """Each transformers spec's split points are modules of the built model, in the order the
    model defines them, its freezable parameters trainable parameters; its batches have the
    rows asked for (and, for token models, the shorter sequence); its loss is the registry's
    and its summed loss is the mean times the valid targets."""
    spec = REAL[name]
    model = spec.build(0)
    modules = [n for n, _ in model.named_modules()]
    assert all(p in modules for p in spec.split_points), set(spec.split_points) - set(modules)
    assert sorted(spec.split_points, key=modules.index) == list(spec.split_points)
    params = dict(model.named_parameters())
    assert all(params[p].requires_grad for p in spec.freezable)
    assert spec.blocks in modules
    assert ARCHITECTURES[name](batch_size=1)[2] is spec.loss
    inputs, target = spec.data(3, 5, spec.seq or 0)
    assert target.shape[0] == 3 and all(v.shape[0] == 3 for v in inputs.values())
    again, _ = spec.data(3, 5, spec.seq or 0)
    assert all(torch.equal(inputs[k], again[k]) for k in inputs)  # a batch is a function of its seed
    out = model(**inputs)
    assert torch.allclose(spec.loss_sum(out, target), spec.loss(out, target) * target.numel(), rtol=1e-5)
    if spec.seq is not None:
        short, short_target = spec.data(2, 5, spec.seq - 3)
        assert short_target.shape[1] == spec.seq - 3
        assert all(v.shape[1] == spec.seq - 3 for v in short.values() if v.dim() > 1)


def test_known_bugs_are_matched_on_what_ran() -> None:
    cfg = Config(model="t5", ranks=2, microbatches=2, schedule="gpipe", plan="split", split=("decoder.block.0",),
                 choose="both", rows=2)
    assert known(cfg) == []  # the split-backward, float64 and DDP-freeze bugs are fixed (issue 27)
    assert effective(cfg, ("zbv", 4)).rows == 1  # 4 samples in 4 microbatches
    assert effective(cfg, ("zbv", 4)).schedule == "zbv"
    assert known(Config(model="swin", ranks=2, microbatches=2, schedule="gpipe", split=("swin.encoder",))) == [
        "swin-export"]


def test_a_pipecut_error_refuses_only_where_the_run_meets_something_new() -> None:
    cfg = Config(model="skip", ranks=2, microbatches=2, schedule="gpipe", split=("layers.3",), steps=3,
                 freeze="inp.weight")
    trail = Trail()
    assert is_refusal(cfg, InputError("x"), trail)  # at compile
    assert not is_refusal(cfg, RuntimeError("x"), trail)  # not a pipecut error
    trail.enter("step 0 call 0", "step", False, "same", "")
    assert is_refusal(cfg, InputError("x"), trail)
    trail.enter("step 0 call 1", "step", False, "same", "")
    assert not is_refusal(cfg, InputError("x"), trail)  # the same call passed before: a bug
    trail.enter("step 1 call 0", "step", False, "same", "frozen")
    assert is_refusal(cfg, InputError("x"), trail)
    changed = PipelineRuntimeError("stage 0: ... a parameter's requires_grad changed after pipecut.compile. ...")
    assert is_refusal(cfg, changed, trail)  # pipecut's own check after a freeze
    assert not is_refusal(cfg, PipelineRuntimeError("rank 1 stopped because rank 0: RuntimeError: ..."), trail)
