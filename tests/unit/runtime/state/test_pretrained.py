"""Hugging Face models built on meta, filled without init=: every tensor as from_pretrained gives
it (bitwise: the same checkpoint values, and the same deterministic init of what no checkpoint
holds), in one process. The pipelined runs are tests/multiprocess/test_pretrained.py."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pipecut.core.meta import is_meta, module_tensors
from pipecut.errors import InputError
from pipecut.runtime.state import pretrained
from pipecut.runtime.state.materialize import check_unexpected, materialize_model, materialize_stage
from pipecut.runtime.state.weights import open_weights
from tests import families

CPU = torch.device("cpu")


def _fill(meta: nn.Module, weights, stage: str | None = None) -> nn.Module:
    """Materialise ``meta`` (or only its submodule ``stage``, as a rank does) from ``weights``."""
    whole = copy.deepcopy(meta)
    part = whole.get_submodule(stage) if stage else whole
    source = open_weights(weights) if weights is not None else None
    materialize_stage(part, (whole,), meta, device=CPU, source=source, init=None, seed=0, where="stage 0 (rank 0)")
    return whole


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_meta_model_from_save_pretrained_dir_equals_from_pretrained(name, tmp_path):
    plain, inputs, *_ = families.FAMILIES[name](batch_size=2)
    plain.save_pretrained(tmp_path)
    meta = families.on_meta(name)[0]
    filled = _fill(meta, tmp_path)
    reference = families.from_pretrained(str(tmp_path))
    want = _tensors(reference)
    got = _tensors(filled)
    assert sorted(got) == sorted(want)
    for key, value in want.items():  # non-persistent buffers (inv_freq, embed_scale) included
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    with torch.no_grad():  # same tensors, same eager code: identical
        torch.testing.assert_close(filled(**inputs).logits, reference(**inputs).logits, rtol=0, atol=0)
    assert all(is_meta(t) for _, t in module_tensors(meta)), "the user's model must stay on meta"


def test_a_stage_gets_only_its_tensors_and_the_rotary_buffers(tmp_path):
    plain = families.FAMILIES["llama"](batch_size=2)[0]
    plain.save_pretrained(tmp_path)
    meta = families.on_meta("llama")[0]
    filled = _fill(meta, tmp_path, stage="model.rotary_emb")
    real = sorted(n for n, t in module_tensors(filled) if not is_meta(t))
    assert real == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    torch.testing.assert_close(filled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_without_weights_the_models_own_init_runs_per_module_and_per_stage_alike():
    """weights=None: each module gets its model's _init_weights (children first, parents after,
    as from_pretrained), under a seed of its name, so a stage gets the values the whole model
    gets. GPT-2's attention rescales its child c_proj (std 0.02 / sqrt(2 * layers)): the parent
    runs although the tensor is its child's."""
    meta = families.on_meta("gpt2")[0]
    whole = materialize_model(meta)
    assert all(torch.isfinite(t).all() for _, t in module_tensors(whole))
    std = meta.config.initializer_range
    c_proj = whole.transformer.h[0].attn.c_proj.weight.std().item()
    c_attn = whole.transformer.h[0].attn.c_attn.weight.std().item()
    assert abs(c_attn - std) < 0.1 * std, c_attn  # 12k samples: the sample std is within ~1%
    assert abs(c_proj - std / (2 * meta.config.n_layer) ** 0.5) < 0.1 * std, c_proj
    part = _fill(meta, None, stage="transformer.h.1")
    for name, t in module_tensors(part):
        if not is_meta(t):
            torch.testing.assert_close(t, dict(module_tensors(whole))[name], rtol=0, atol=0)
    llama = materialize_model(families.on_meta("llama")[0])
    torch.testing.assert_close(llama.model.rotary_emb.inv_freq,
                               families.FAMILIES["llama"]()[0].model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_tensors_the_model_declares_self_initialised_are_not_required(tmp_path):
    """A persistent tensor absent from the weights is refused, unless the model's
    _keys_to_ignore_on_load_missing names it: then its _init_weights sets it, as from_pretrained."""
    plain = families.FAMILIES["llama"](batch_size=2)[0]
    plain.save_pretrained(tmp_path)
    state = {k: v for k, v in plain.state_dict().items() if k != "model.norm.weight"}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    meta = families.on_meta("llama")[0]
    with pytest.raises(InputError, match=r"lack 1 tensor\(s\) this stage needs, e\.g\. \['model\.norm\.weight'\]"):
        _fill(meta, tmp_path)
    meta._keys_to_ignore_on_load_missing = [r"model\.norm\.weight"]
    filled = _fill(meta, tmp_path)
    torch.testing.assert_close(filled.model.norm.weight, torch.ones(plain.config.hidden_size), rtol=0, atol=0)
    torch.testing.assert_close(filled.model.norm.weight, families.from_pretrained(str(tmp_path)).model.norm.weight,
                               rtol=0, atol=0)
    assert pretrained.self_initialised(nn.Linear(2, 2), ["weight"]) == set()


def test_old_checkpoints_with_rotary_buffers_load_into_hf_models_only():
    plain = families.FAMILIES["llama"](batch_size=2)[0]
    old = {**plain.state_dict(), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    check_unexpected(open_weights(old), families.on_meta("llama")[0])  # from_pretrained ignores it

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("position_ids", torch.arange(2), persistent=False)

    weights = {**Plain().state_dict(), "rotary_emb.inv_freq": torch.ones(2)}
    with pytest.raises(InputError, match=r"1 tensor\(s\) the model has no parameter or buffer for.*rotary_emb.inv_freq"):
        check_unexpected(open_weights(weights), Plain())


def test_the_name_written_for_a_tied_weight_is_the_one_save_pretrained_keeps():
    gpt2 = families.on_meta("gpt2")[0]
    tied = ["transformer.wte.weight", "lm_head.weight"]
    assert pretrained.saved_name(tied, gpt2) == "transformer.wte.weight"
    # HF drops the _tied_weights_keys names whatever the order; other models keep the first.
    assert pretrained.saved_name(tied[::-1], gpt2) == "transformer.wte.weight"
    assert pretrained.saved_name(tied[::-1], None) == "lm_head.weight"
    assert pretrained.saved_name(tied[::-1], nn.Linear(2, 2)) == "lm_head.weight"
    assert pretrained.saved_name(["lm_head.weight"], gpt2) == "lm_head.weight"  # one name: kept
