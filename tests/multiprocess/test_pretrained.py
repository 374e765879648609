"""docs/big-models.md's recipe, unchanged, on five Hugging Face families at K = 2: the model
built on meta with ``AutoModelForCausalLM.from_config``, compiled with ``weights=`` its
``save_pretrained`` directory and no ``init=``. What no checkpoint holds (rotary ``inv_freq``,
Gemma's ``embed_scale``) is computed on each rank for its stage as ``from_pretrained`` computes
it, so loss and every gradient match ``from_pretrained`` of the same directory in one process.

Tolerances: as tests/multiprocess/test_materialize.py (the pipeline runs the captured graph, the
reference the eager modules; only summation order differs): atol=1e-5, rtol=1e-4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipecut
from examples import zoo
from pipecut.core.batching import split_microbatches
from pipecut.core.meta import is_meta, module_tensors
from tests import families
from tests.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(500)]

ATOL, RTOL = 1e-5, 1e-4
M = 4


def _real_bytes(module: torch.nn.Module) -> int:
    real = {id(t): t for _, t in module_tensors(module) if not is_meta(t)}
    return sum(t.numel() * t.element_size() for t in real.values())


def _families(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    for name in families.FAMILIES:
        model, inputs, loss_fn, target = families.on_meta(name)
        pipe = pipecut.compile(
            model, inputs, world, loss_fn=loss_fn, target=target, microbatches=M,
            weights=f"{root}/{name}", runtime=pipecut.RuntimeOptions(timeout=60),
        )
        loss = pipe.step(inputs, target)
        out[name] = {
            "loss": loss,
            "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None},
            "buffers": {n: b.clone() for n, b in pipe.named_buffers()},
            "stages": [len(s.nodes) for s in pipe.plan.stages],
            "capture": pipe.plan.capture.value,
            "cut_constants": zoo.cut_constants(pipe.plan),
            "held_bytes": _real_bytes(pipe.captured.gm),
            "stage_bytes": sum(_real_bytes(m) for m in pipe.modules),
            "user_model_meta": all(is_meta(t) for _, t in module_tensors(model)),
        }
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("families")
    for name, build in families.FAMILIES.items():
        build(batch_size=8, seed=0)[0].save_pretrained(path / name)
    return path


@pytest.fixture(scope="module")
def k2(root):
    return run_ranks(_families, 2, str(root), timeout=480)


def _reference(path: str, name: str) -> tuple[torch.Tensor, torch.nn.Module]:
    """``from_pretrained`` of the directory, stepped microbatch by microbatch."""
    model = families.from_pretrained(path)
    _, inputs, loss_fn, target = families.FAMILIES[name](batch_size=8, seed=0)
    total = torch.zeros(())
    for mb, t in zip(split_microbatches(inputs, M, 8), split_microbatches(target, M, 8, "target")):
        loss = loss_fn(model(**mb), t) / M
        loss.backward()
        total += loss.detach()
    return total, model


@pytest.mark.parametrize("name", list(families.FAMILIES))
def test_meta_model_with_weights_and_no_init_matches_from_pretrained(k2, root, name):
    ranks = [r[name] for r in k2]
    report = zoo.compare(_reference(str(root / name), name), ranks, ATOL, RTOL)
    assert len(report["stages"]) == 2 and all(report["stages"])
    buffers = {n for r in ranks for n in r["buffers"]}
    if name != "gpt2":  # the rotary buffer was computed on its rank and compared above
        assert "model.rotary_emb.inv_freq" in buffers, buffers
    for rank, r in enumerate(ranks):
        assert r["user_model_meta"], f"{name}: compile changed the user's meta model"
        # Everything real on this rank (its whole captured graph) is its stage's tensors.
        assert r["held_bytes"] == r["stage_bytes"], (name, rank, r["held_bytes"], r["stage_bytes"])
