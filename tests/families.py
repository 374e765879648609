"""Small decoder-only Hugging Face models of five families, for the meta-model and
``save_pretrained`` tests: configs only (random weights, nothing downloaded), every dropout at 0,
so a pipelined run can be compared exactly with the plain model, and transformers' default
attention, as a user gets it (``attention=`` builds another).

Llama, Qwen2 and GPT-2 are the zoo's (:mod:`examples.zoo`); Mistral (sliding-window attention)
and Gemma (scaled embeddings with a non-persistent ``embed_scale``, RMSNorm around 1 + weight,
tied head) are built the same way here, and kept out of the zoo so that the tests iterating it
do not grow.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from examples import zoo


def mistral(batch_size: int = 8, seed: int = 0, attention: str | None = None) -> zoo.Built:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=zoo.VOCAB, hidden_size=zoo.HIDDEN, intermediate_size=2 * zoo.HIDDEN,
        num_hidden_layers=zoo.LAYERS, num_attention_heads=zoo.HEADS, num_key_value_heads=2,
        max_position_embeddings=zoo.SEQ, sliding_window=8, attention_dropout=0.0,
        **zoo.attention_settings(attention),
    )
    model = MistralForCausalLM(config)
    ids, target = zoo._tokens(batch_size)
    return model, {"input_ids": ids}, zoo.logits_ce, target


def gemma(batch_size: int = 8, seed: int = 0, attention: str | None = None) -> zoo.Built:
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(seed)
    config = GemmaConfig(
        vocab_size=zoo.VOCAB, hidden_size=zoo.HIDDEN, intermediate_size=2 * zoo.HIDDEN,
        num_hidden_layers=zoo.LAYERS, num_attention_heads=zoo.HEADS, num_key_value_heads=2,
        head_dim=zoo.HIDDEN // zoo.HEADS, max_position_embeddings=zoo.SEQ,
        attention_dropout=0.0, **zoo.attention_settings(attention),
    )
    model = GemmaForCausalLM(config)
    ids, target = zoo._tokens(batch_size)
    return model, {"input_ids": ids}, zoo.logits_ce, target


FAMILIES: dict[str, Callable[..., zoo.Built]] = {
    "llama": zoo.llama,
    "mistral": mistral,
    "qwen2": zoo.qwen2,
    "gemma": gemma,
    "gpt2": zoo.gpt2,
}


def on_meta(name: str, batch_size: int = 8, seed: int = 0, attention: str | None = None) -> zoo.Built:
    """docs/big-models.md's recipe: ``AutoModelForCausalLM.from_config`` on meta, with the family's
    example batch and loss (and its config's attention)."""
    from transformers import AutoModelForCausalLM

    plain, inputs, loss_fn, target = FAMILIES[name](batch_size=batch_size, seed=seed, attention=attention)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain.config)
    return model, inputs, loss_fn, target


def from_pretrained(path: str) -> torch.nn.Module:
    """The one-process reference: ``from_pretrained`` of ``path``, in training mode (as the
    model compiled), with the attention a loaded model gets by default, as the families are
    built with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).train()
