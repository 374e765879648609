"""About forty Hugging Face architectures, each from a tiny config with random weights.

The issue 27 sweep: every architecture at the issue's sizes (4 layers where the config has
layers, hidden 64, every dropout 0; transformers' default attention, or the one
named by ``attention=``), built the same way as
:mod:`examples.zoo` (nothing downloaded). :data:`ARCHITECTURES` maps a stable lowercase name
to a factory ``factory(batch_size=8, seed=0, layers=4, attention=None) -> (model, inputs, loss_fn, target)``.

Most architectures differ only in their config classes and settings, so each is one
:class:`Architecture` row (config, model class, task, settings) rather than a function; the
task says which inputs and loss it gets. Where :mod:`examples.zoo` already builds an
architecture (ResNet, ViT, GPT-2, BERT, Llama, Qwen2, T5), the registry points at that
factory with ``layers=4``: one piece of code per model.

A factory refuses (``ValueError``) a config that keeps a dropout, drop-path or layer-drop
probability above 0: a pipelined step is compared exactly with the plain model, and random
masks drawn in a different order would make that comparison meaningless.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from examples import zoo
from examples.zoo import CLASSES, HEADS, HIDDEN, IMAGE, SEQ, VOCAB, Built, logits_ce

LAYERS = 4
"""The issue's depth: 4 layers (encoder and decoder each; 2 + 2 blocks for staged vision models)."""

_DROPOUT_WORDS = ("dropout", "pdrop", "drop_path", "layerdrop")


class Task(enum.Enum):
    """What the model is trained on, which fixes its inputs and target."""

    CAUSAL_LM = "causal-lm"
    """``input_ids`` → next-token logits."""
    MASKED_LM = "masked-lm"
    """``input_ids`` + an ``attention_mask`` with padding (so the mask matters) → token logits."""
    SEQ2SEQ = "seq2seq"
    """``input_ids`` + ``decoder_input_ids`` (labels shifted right) → label logits."""
    IMAGE_CLASSIFICATION = "image-classification"
    """``pixel_values`` (3 × 32 × 32) → class logits."""


def _layer_keys(*names: str) -> Callable[[int], dict[str, Any]]:
    """Settings that give a config ``n`` layers under each of ``names``."""
    return lambda n: dict.fromkeys(names, n)


def _hidden_layers(n: int) -> dict[str, Any]:
    """The usual name of the depth."""
    return {"num_hidden_layers": n}


def _two_stages(n: int) -> dict[str, Any]:
    """A staged vision model (Swin, ConvNeXt) with ``n`` blocks over two stages."""
    return {"depths": [n // 2, n - n // 2]}


@dataclass(frozen=True, kw_only=True, slots=True)
class Architecture:
    """One transformers architecture as data: called like a zoo factory, it builds the model."""

    config: str
    """The config class in ``transformers``."""
    model: str
    """The model class in ``transformers`` (with its task head)."""
    task: Task
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Config keyword arguments besides the depth."""
    layers: Callable[[int], dict[str, Any]] = _hidden_layers
    """The depth as config keyword arguments (names differ between families)."""

    def __call__(self, batch_size: int = 8, seed: int = 0, layers: int = LAYERS, attention: str | None = None) -> Built:
        torch.manual_seed(seed)
        config = getattr(transformers, self.config)(**self.settings, **self.layers(layers),
                                                    **zoo.attention_settings(attention))
        check_no_dropout(config)
        model = getattr(transformers, self.model)(config)
        return model, *_inputs(self.task, batch_size)  # type: ignore[return-value]


def check_no_dropout(config: Any, where: str = "") -> None:
    """Refuse a config (or one of its sub-configs) that keeps a random-drop probability > 0."""
    for key, value in vars(config).items():
        if isinstance(value, transformers.PretrainedConfig):
            check_no_dropout(value, f"{where}{key}.")
        elif any(w in key for w in _DROPOUT_WORDS) and isinstance(value, float) and value > 0:
            raise ValueError(f"{type(config).__name__}.{where}{key} = {value}: set it to 0.0 so the "
                             f"pipelined step can be compared exactly with the plain model")


def _inputs(task: Task, batch_size: int) -> tuple[Any, Callable[[Any, Any], torch.Tensor], torch.Tensor]:
    """Inputs, loss and target for ``task``, drawn after the weights (same seed, same batch)."""
    if task is Task.IMAGE_CLASSIFICATION:
        x, y = zoo._images(batch_size)
        return {"pixel_values": x}, logits_ce, y
    if task is Task.SEQ2SEQ:
        src = torch.randint(1, VOCAB, (batch_size, SEQ))
        labels = torch.randint(1, VOCAB, (batch_size, SEQ))
        decoder_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
        return {"input_ids": src, "decoder_input_ids": decoder_ids}, logits_ce, labels
    ids, target = zoo._tokens(batch_size)
    if task is Task.CAUSAL_LM:
        return {"input_ids": ids}, logits_ce, target
    mask = torch.ones_like(ids)
    mask[: batch_size // 2, SEQ - 4 :] = 0  # some padding, so the mask matters
    return {"input_ids": ids, "attention_mask": mask}, logits_ce, target


# --- shared settings ---------------------------------------------------------------------------

_DECODER = {  # Llama-style decoders: GQA with 2 key/value heads, no cache
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
    "num_attention_heads": HEADS, "num_key_value_heads": 2, "max_position_embeddings": SEQ,
    "attention_dropout": 0.0, "pad_token_id": 0, "bos_token_id": 0,
    "eos_token_id": 0,
}
_ENCODER = {  # BERT-style encoders
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
    "intermediate_size": 2 * HIDDEN, "max_position_embeddings": SEQ + 2,  # RoBERTa offsets by 2
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pad_token_id": 1,
}
_BART = {  # BART-style encoder-decoders
    "vocab_size": VOCAB, "d_model": HIDDEN, "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS, "encoder_ffn_dim": 2 * HIDDEN, "decoder_ffn_dim": 2 * HIDDEN,
    "max_position_embeddings": SEQ, "dropout": 0.0, "attention_dropout": 0.0,
    "activation_dropout": 0.0, "pad_token_id": 1, "bos_token_id": 0,
    "eos_token_id": 2, "decoder_start_token_id": 0, "forced_eos_token_id": None,
}
_BART_LAYERS = _layer_keys("encoder_layers", "decoder_layers")
_MOE = {"num_experts_per_tok": 2, "output_router_logits": False}
_VIT = {
    "hidden_size": HIDDEN, "num_attention_heads": HEADS, "intermediate_size": 2 * HIDDEN,
    "image_size": IMAGE, "patch_size": 8, "num_labels": CLASSES, "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
_CLIP_VISION = {
    "hidden_size": HIDDEN, "num_attention_heads": HEADS, "intermediate_size": 2 * HIDDEN,
    "image_size": IMAGE, "patch_size": 8, "attention_dropout": 0.0,
}


def _causal(config: str, model: str, layers: str = "num_hidden_layers", **settings: Any) -> Architecture:
    return Architecture(config=config, model=model, task=Task.CAUSAL_LM,
                        settings={**_DECODER, **settings}, layers=_layer_keys(layers))


def _gpt_neo_layers(n: int) -> dict[str, Any]:
    """GPT-Neo alternates global and local attention; its pattern must cover all ``n`` layers."""
    return {"num_layers": n, "attention_types": [[["global", "local"], n // 2]]}


def _clip(batch_size: int = 8, seed: int = 0, layers: int = LAYERS, attention: str | None = None) -> Built:
    """CLIP's vision tower with its image-classification head (CLIPConfig nests two configs)."""
    torch.manual_seed(seed)
    config = transformers.CLIPConfig(
        vision_config={**_CLIP_VISION, "num_hidden_layers": layers},
        text_config={"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 1,
                     "num_attention_heads": HEADS, "intermediate_size": 2 * HIDDEN,
                     "max_position_embeddings": SEQ, "attention_dropout": 0.0,
                     "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
        projection_dim=HIDDEN, num_labels=CLASSES, **zoo.attention_settings(attention),
    )
    check_no_dropout(config)
    model = transformers.CLIPForImageClassification(config)
    return model, *_inputs(Task.IMAGE_CLASSIFICATION, batch_size)  # type: ignore[return-value]


ARCHITECTURES: dict[str, Callable[..., Built]] = {
    # --- encoders (masked LM) ---
    "albert": Architecture(
        config="AlbertConfig", model="AlbertForMaskedLM", task=Task.MASKED_LM,
        settings={**_ENCODER, "embedding_size": HIDDEN // 2, "classifier_dropout_prob": 0.0}),
    "bert": functools.partial(zoo.bert, layers=LAYERS),
    "big_bird": Architecture(
        config="BigBirdConfig", model="BigBirdForMaskedLM", task=Task.MASKED_LM,
        settings={**_ENCODER, "attention_type": "original_full"}),
    "deberta_v2": Architecture(
        config="DebertaV2Config", model="DebertaV2ForMaskedLM", task=Task.MASKED_LM,
        settings={**_ENCODER, "pooler_dropout": 0.0}),
    "distilbert": Architecture(
        config="DistilBertConfig", model="DistilBertForMaskedLM", task=Task.MASKED_LM,
        settings={"vocab_size": VOCAB, "dim": HIDDEN, "n_heads": HEADS, "hidden_dim": 2 * HIDDEN,
                  "max_position_embeddings": SEQ, "dropout": 0.0, "attention_dropout": 0.0,
                  "qa_dropout": 0.0, "seq_classif_dropout": 0.0, "pad_token_id": 1},
        layers=_layer_keys("n_layers")),
    "electra": Architecture(
        config="ElectraConfig", model="ElectraForMaskedLM", task=Task.MASKED_LM,
        settings={**_ENCODER, "embedding_size": HIDDEN // 2, "summary_last_dropout": 0.0}),
    "roberta": Architecture(config="RobertaConfig", model="RobertaForMaskedLM", task=Task.MASKED_LM,
                            settings=_ENCODER),
    "xlm_roberta": Architecture(config="XLMRobertaConfig", model="XLMRobertaForMaskedLM",
                                task=Task.MASKED_LM, settings=_ENCODER),
    # --- encoder-decoders ---
    "bart": Architecture(config="BartConfig", model="BartForConditionalGeneration",
                         task=Task.SEQ2SEQ, settings=_BART, layers=_BART_LAYERS),
    "mbart": Architecture(config="MBartConfig", model="MBartForConditionalGeneration",
                          task=Task.SEQ2SEQ, settings=_BART, layers=_BART_LAYERS),
    "pegasus": Architecture(config="PegasusConfig", model="PegasusForConditionalGeneration",
                            task=Task.SEQ2SEQ, settings={**_BART, "pad_token_id": 0},
                            layers=_BART_LAYERS),
    "t5": functools.partial(zoo.t5, layers=LAYERS),
    # --- decoders (causal LM) ---
    "bloom": _causal("BloomConfig", "BloomForCausalLM", "n_layer", n_head=HEADS, hidden_dropout=0.0),
    "deepseek_v3": _causal(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", **_MOE, num_key_value_heads=HEADS, moe_intermediate_size=HIDDEN,
        n_shared_experts=1, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "falcon": _causal("FalconConfig", "FalconForCausalLM", num_kv_heads=HEADS, hidden_dropout=0.0,
                      new_decoder_architecture=False, multi_query=False, parallel_attn=True),
    "gemma": _causal("GemmaConfig", "GemmaForCausalLM", head_dim=HIDDEN // HEADS),
    "gemma2": _causal("Gemma2Config", "Gemma2ForCausalLM", head_dim=HIDDEN // HEADS,
                      query_pre_attn_scalar=HIDDEN // HEADS, sliding_window=SEQ // 2),
    "gpt2": functools.partial(zoo.gpt2, layers=LAYERS),
    "gpt_neo": Architecture(
        config="GPTNeoConfig", model="GPTNeoForCausalLM", task=Task.CAUSAL_LM,
        settings={**_DECODER, "num_heads": HEADS, "window_size": SEQ // 2, "embed_dropout": 0.0,
                  "resid_dropout": 0.0, "classifier_dropout": 0.0},
        layers=_gpt_neo_layers),
    "gpt_neox": _causal("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_dropout=0.0, classifier_dropout=0.0,
                        rotary_pct=0.5, use_parallel_residual=True),
    "gptj": _causal("GPTJConfig", "GPTJForCausalLM", "n_layer", n_embd=HIDDEN, n_head=HEADS, n_positions=SEQ,
                    rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": functools.partial(zoo.llama, layers=LAYERS),
    "mistral": _causal("MistralConfig", "MistralForCausalLM", sliding_window=SEQ // 2),
    "mixtral": _causal("MixtralConfig", "MixtralForCausalLM", **_MOE, num_local_experts=4,
                       router_jitter_noise=0.0),
    "olmo": _causal("OlmoConfig", "OlmoForCausalLM"),
    "olmo2": _causal("Olmo2Config", "Olmo2ForCausalLM"),
    "opt": _causal("OPTConfig", "OPTForCausalLM", ffn_dim=2 * HIDDEN, word_embed_proj_dim=HIDDEN,
                   dropout=0.0, activation_dropout=0.0, layerdrop=0.0, pad_token_id=1),
    "phi": _causal("PhiConfig", "PhiForCausalLM", partial_rotary_factor=0.5, resid_pdrop=0.0,
                   embd_pdrop=0.0),
    "phi3": _causal("Phi3Config", "Phi3ForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0),
    "qwen2": functools.partial(zoo.qwen2, layers=LAYERS),
    "qwen2_moe": _causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **_MOE, num_experts=4,
                         moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN,
                         decoder_sparse_step=1),
    "qwen3": _causal("Qwen3Config", "Qwen3ForCausalLM", head_dim=HIDDEN // HEADS),
    "qwen3_moe": _causal("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_MOE, num_experts=4,
                         head_dim=HIDDEN // HEADS, moe_intermediate_size=HIDDEN, decoder_sparse_step=1),
    "stablelm": _causal("StableLmConfig", "StableLmForCausalLM", hidden_dropout=0.0,
                        partial_rotary_factor=0.5),
    "starcoder2": _causal("Starcoder2Config", "Starcoder2ForCausalLM", residual_dropout=0.0,
                          embedding_dropout=0.0, sliding_window=SEQ // 2),
    # --- vision ---
    "clip": _clip,
    "convnext": Architecture(
        config="ConvNextConfig", model="ConvNextForImageClassification", task=Task.IMAGE_CLASSIFICATION,
        settings={"num_channels": 3, "patch_size": 4, "num_stages": 2, "hidden_sizes": [HIDDEN // 2, HIDDEN],
                  "image_size": IMAGE, "drop_path_rate": 0.0, "num_labels": CLASSES},
        layers=_two_stages),
    "deit": Architecture(config="DeiTConfig", model="DeiTForImageClassification",
                         task=Task.IMAGE_CLASSIFICATION, settings=_VIT),
    "resnet": functools.partial(zoo.resnet, layers=LAYERS),
    "swin": Architecture(
        config="SwinConfig", model="SwinForImageClassification", task=Task.IMAGE_CLASSIFICATION,
        settings={"image_size": IMAGE, "patch_size": 4, "embed_dim": HIDDEN // 2, "num_heads": [2, 4],
                  "window_size": 4, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                  "drop_path_rate": 0.0, "num_labels": CLASSES},
        layers=_two_stages),
    "vit": functools.partial(zoo.vit, layers=LAYERS),
}
"""Factories by stable lowercase name: ``ARCHITECTURES["mixtral"](batch_size=8, seed=0)``.

Mixture-of-experts models (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``deepseek_v3``) route
each token to 2 of 4 experts with no router noise: the pipelined and the plain model see the
same weights and inputs, so they route the same way and can be compared."""
