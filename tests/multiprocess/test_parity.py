"""Pipelined loss and gradients equal the unsplit model's, at K=2 and K=3, on every example.

Each test forks K ranks once and runs several scenarios in them (forking is the expensive
part). The reference is computed in the parent on a fresh model built with the same seed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import pipecut
from examples import EXAMPLES
from tests.harness import run_ranks
from tests.reference import COUNTED, assert_parity, pipeline_grads, reference

pytestmark = pytest.mark.dist


def hf_gpt2(batch_size: int = 8, seed: int = 0):
    """A small transformers GPT-2 from its config: symbolic_trace fails, torch.export captures it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 128, (batch_size, 17))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    return model, {"input_ids": tokens[:, :-1]}, loss_fn, tokens[:, 1:]


FACTORIES = {**EXAMPLES, "hf_gpt2": hf_gpt2}
# (factory, schedule, microbatches, reference microbatch by microbatch?); None: left out
SCENARIOS = [
    ("mlp", "gpipe", 4, False),
    ("gpt", "gpipe", 4, False),
    ("gpt", "1f1b", 8, False),
    ("gpt", "zero-bubble", 8, False),
    ("resnet", "gpipe", 4, True),  # BatchNorm: GPipe semantics, statistics per microbatch
    ("resnet", "zero-bubble", 4, True),
    ("hf_gpt2", "gpipe", 4, False),
    ("gpt", None, None, False),  # left out: the planner chooses both, and the result pipelines
]


def _scenarios(rank: int, world: int, scenarios: list[tuple[str, Any, Any, bool]]) -> list[dict[str, Any]]:
    results = []
    for name, schedule, m, _ in scenarios:
        model, inputs, loss_fn, target = FACTORIES[name]()
        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target, microbatches=m,
            schedule=schedule, runtime=pipecut.RuntimeOptions(timeout=60), measure=COUNTED,
        )
        loss = pipe.step(inputs, target)
        results.append({
            "loss": loss, "grads": pipeline_grads(model, pipe), "capture": pipe.plan.capture.value,
            "stages": [len(s.nodes) for s in pipe.plan.stages], "microbatches": pipe.plan.microbatches,
            "stages_per_rank": pipe.plan.stages_per_rank,
        })
    return results


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_matches_unsplit_model(world: int) -> None:
    per_rank = run_ranks(_scenarios, world, SCENARIOS, timeout=400)
    for i, (name, _, m, per_mb) in enumerate(SCENARIOS):
        ref_loss, ref_grads = reference(FACTORIES[name], m, per_mb)
        results = [rank[i] for rank in per_rank]
        assert all(n > 0 for n in results[0]["stages"])
        assert len(results[0]["stages"]) == world * results[0]["stages_per_rank"]
        if m is None:
            assert results[0]["microbatches"] > 1  # the default pipelines
        assert_parity(ref_loss, ref_grads, results)
    assert per_rank[0][SCENARIOS.index(("hf_gpt2", "gpipe", 4, False))]["capture"] == "export"
    assert per_rank[0][0]["capture"] == "symbolic_trace"
