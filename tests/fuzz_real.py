"""The fuzzer's transformers architectures: models from examples/architectures.py's registry,
each behind a thin :class:`~tests.fuzz_spec.ModelSpec`.

Why these: the hand-written zoo (tests/fuzz_models.py) missed bugs that only real models show:
an encoder whose output crosses into every decoder block (T5, BART), one layer's weights used
by every layer (ALBERT), a parameter added to an activation of the same shape (ViT's position
embeddings, the CLS token), grouped-query attention with rotary embeddings (Llama), experts
stored as stacked parameters and routed per token (Mixtral, Qwen2-MoE), shifted windows (Swin),
HF BatchNorm (ResNet), tied embeddings whose two uses sit far apart (GPT-2, BERT, T5, BART).

The registry builds every model and batch (``factory(batch_size, seed, layers)``); this module
only adds what the fuzzer draws from: where a pinned split may cut, which parameters a run may
freeze, and a summed loss. Two layers (encoder and decoder each) keep a configuration to a few
seconds; the split points and parameter names are checked against the built models in
tests/unit/test_fuzz_config.py.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.architectures import ARCHITECTURES
from examples.zoo import SEQ, logits_ce
from tests.fuzz_spec import ModelSpec

LAYERS = 2
"""Blocks per stack (the registry's default is the issue's 4; 2 halves compile and step time)."""


def logits_ce_sum(out: Any, target: torch.Tensor) -> torch.Tensor:
    """:func:`examples.zoo.logits_ce` summed over the valid targets (-100 is padding)."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                           reduction="sum")


@functools.lru_cache(maxsize=64)
def _example(arch: str, rows: int, seed: int, default: torch.dtype) -> tuple[Any, torch.Tensor]:
    """The registry's batch of ``rows`` for ``seed`` under the ``default`` dtype (the factory
    builds a model too: the cache keeps each batch's cost to once per process)."""
    _, inputs, _, target = ARCHITECTURES[arch](batch_size=rows, seed=seed, layers=LAYERS)
    return inputs, target


def _data(arch: str, tokens: bool) -> Any:
    def data(rows: int, seed: int, seq: int) -> tuple[Any, torch.Tensor]:
        inputs, target = _example(arch, rows, 1_000_000 + seed, torch.get_default_dtype())  # apart from weight seeds
        cut = tokens and 0 < seq < SEQ

        def fresh(t: torch.Tensor) -> torch.Tensor:  # a shorter sequence: every [rows, SEQ] tensor cut
            return (t[:, :seq] if cut and t.dim() >= 2 and t.shape[1] == SEQ else t).clone()

        return {k: fresh(v) for k, v in inputs.items()}, fresh(target)

    return data


def _model(arch: str) -> Any:
    def build(seed: int, attention: str | None = None) -> nn.Module:
        return ARCHITECTURES[arch](batch_size=1, seed=seed, layers=LAYERS, attention=attention)[0]

    return build


def _real(arch: str, *, split_points: tuple[str, ...], blocks: str, freezable: tuple[str, ...],
          tokens: bool = True, batchnorm: bool = False) -> ModelSpec:
    return ModelSpec(name=arch, model=_model(arch), data=_data(arch, tokens), loss=logits_ce,
                     loss_sum=logits_ce_sum, split_points=split_points, blocks=blocks, freezable=freezable,
                     seq=SEQ if tokens else None, batchnorm=batchnorm, real=True)


def _decoder(prefix: str, norm: str) -> tuple[str, ...]:
    """A decoder-only LM's split points: each block, its MLP, the final norm, the head."""
    return (*(p for i in range(LAYERS) for p in (f"{prefix}.{i}", f"{prefix}.{i}.mlp")), norm, "lm_head")


REAL: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _real("vit", tokens=False, blocks="vit.layers",
              split_points=("vit.layers.0", "vit.layers.1", "vit.layers.1.mlp", "vit.layernorm", "classifier"),
              freezable=("vit.embeddings.position_embeddings", "vit.embeddings.cls_token",
                         "vit.layers.1.mlp.fc1.weight")),
        _real("swin", tokens=False, blocks="swin.encoder.layers",
              split_points=("swin.encoder.layers.0", "swin.encoder.layers.1", "swin.layernorm", "classifier"),
              freezable=("swin.encoder.layers.0.blocks.0.attention.relative_position_bias.relative_position_bias_table",
                         "classifier.weight")),
        _real("resnet", tokens=False, batchnorm=True, blocks="resnet.encoder.stages",
              split_points=("resnet.encoder.stages.0", "resnet.encoder.stages.1", "classifier"),
              freezable=("resnet.embedder.embedder.normalization.weight", "classifier.1.weight")),
        _real("gpt2", blocks="transformer.h", split_points=_decoder("transformer.h", "transformer.ln_f"),
              freezable=("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.1.attn.c_attn.weight")),
        _real("llama", blocks="model.layers", split_points=_decoder("model.layers", "model.norm"),
              freezable=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")),
        _real("mixtral", blocks="model.layers", split_points=_decoder("model.layers", "model.norm"),
              freezable=("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj")),
        _real("qwen2_moe", blocks="model.layers", split_points=_decoder("model.layers", "model.norm"),
              freezable=("model.layers.0.mlp.shared_expert_gate.weight", "model.layers.1.mlp.experts.down_proj")),
        _real("bert", blocks="bert.encoder.layer",
              split_points=("bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.1.output", "cls"),
              freezable=("bert.embeddings.word_embeddings.weight", "bert.embeddings.position_embeddings.weight",
                         "cls.predictions.transform.dense.weight")),
        _real("albert", blocks="albert.encoder.albert_layer_groups",  # one layer, run LAYERS times
              split_points=("albert.encoder", "predictions"),
              freezable=("albert.embeddings.word_embeddings.weight",
                         "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight")),
        _real("t5", blocks="decoder.block",
              split_points=("encoder.block.0", "encoder.block.1", "encoder.final_layer_norm", "decoder.block.0",
                            "decoder.block.1", "decoder.final_layer_norm", "lm_head"),
              freezable=("shared.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                         "decoder.block.1.layer.1.EncDecAttention.q.weight")),
        _real("bart", blocks="model.decoder.layers",
              split_points=("model.encoder.layers.0", "model.encoder.layers.1", "model.decoder",
                            "model.decoder.layers.1", "lm_head"),
              freezable=("model.shared.weight", "model.encoder.embed_positions.weight",
                         "model.decoder.layers.0.encoder_attn.k_proj.weight")),
    )
}
"""The transformers architectures the fuzzer draws, by their registry names."""
