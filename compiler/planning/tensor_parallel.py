"""The model's attention heads, which a tensor group splits whole (and whole KV heads): read off
a Hugging Face config, for ``compile`` over a "tp" dimension and for a cluster plan's sizes T
(:mod:`pipecut.planning.cluster.tables`)."""

from __future__ import annotations

from typing import Any

__all__ = ["head_counts"]


def head_counts(model: Any) -> dict[str, int]:
    """``{"attention heads": h, "KV heads": kv}`` from a Hugging Face config (empty without one).
    A config that gives a count per stage of the model (Swin's ``num_heads``, a list) names each:
    ``"attention heads of stage 2"``."""
    cfg = getattr(model, "config", None)
    heads = _counts(getattr(cfg, "num_attention_heads", None))
    kv = _counts(getattr(cfg, "num_key_value_heads", None)) or heads
    return {f"{label} of stage {i}" if len(counts) > 1 else label: n
            for label, counts in (("attention heads", heads), ("KV heads", kv)) for i, n in enumerate(counts)}


def _counts(value: Any) -> list[int]:
    """A config's head count: one, or one per stage of the model; none where it is absent or 0."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if v]
