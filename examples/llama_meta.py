"""Llama 3.1 at real size, built on the meta device: for planning hardware that is not here.

The configurations are those of Llama-3.1-8B, 70B and 405B written out by hand (no hub access
needed); the model is built under ``torch.device("meta")`` in bfloat16, so it has shapes and
dtypes but no storage, and the inputs are meta too. Such a model cannot run here; it can be
captured and planned from a device profile without any arithmetic::

    pipecut plan examples.llama_meta:build_8b --device-profile H100-SXM --devices 8 \\
        --microbatches 8 --schedule 1f1b

Each factory returns ``(model, inputs, loss_fn, target)`` like the other examples, with a
batch of ``batch_size`` sequences of ``seq`` tokens (default 8 x 8192). Attention is SDPA (what
an H100 would run; its FLOPs are counted by the same formula as the CUDA kernels'). Llama 3.1's
"llama3" RoPE frequency scaling is left out: it changes the rotary frequencies, no shape and no
FLOP count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SIZES: dict[str, dict[str, int]] = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672),
    "405b": dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                 intermediate_size=53248),
}
VOCAB = 128256
ROPE_THETA = 500000.0


def logits_ce(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def config(size: str, **overrides: Any) -> Any:
    """The ``LlamaConfig`` of Llama-3.1-``size`` (``8b``, ``70b``, ``405b``); ``overrides``
    replace fields (a test shrinks the layers)."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=VOCAB, max_position_embeddings=131072, rope_theta=ROPE_THETA, rms_norm_eps=1e-5,
        tie_word_embeddings=False, use_cache=False, attention_dropout=0.0, attn_implementation="sdpa",
        **SIZES[size],
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def build(size: str = "8b", batch_size: int = 8, seed: int = 0, seq: int = 8192, **overrides: Any) -> Any:
    """Llama-3.1-``size`` on meta in bfloat16, with meta token ids of ``batch_size`` x ``seq``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config(size, **overrides)).to(torch.bfloat16)
        tokens = torch.zeros(batch_size, seq, dtype=torch.long)
        target = torch.zeros(batch_size, seq, dtype=torch.long)
    return model, {"input_ids": tokens}, logits_ce, target


def build_8b(batch_size: int = 8, seed: int = 0) -> Any:
    return build("8b", batch_size, seed)


def build_70b(batch_size: int = 8, seed: int = 0) -> Any:
    return build("70b", batch_size, seed)


def build_405b(batch_size: int = 8, seed: int = 0) -> Any:
    return build("405b", batch_size, seed)
