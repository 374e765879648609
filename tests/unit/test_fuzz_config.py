"""The fuzzer's configuration space (tests/fuzz_config.py), without running anything."""

from __future__ import annotations

import dataclasses

from tests.fuzz_config import FEATURES, Config, draw, problems, simpler, spread


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
