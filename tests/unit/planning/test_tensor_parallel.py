"""pipecut.planning.tensor_parallel: the heads a tensor group splits, from a Hugging Face config."""

from __future__ import annotations

from types import SimpleNamespace

from pipecut.planning.tensor_parallel import head_counts


def test_head_counts_read_the_config() -> None:
    heads = head_counts(SimpleNamespace(config=SimpleNamespace(num_attention_heads=64, num_key_value_heads=8)))
    assert heads == {"attention heads": 64, "KV heads": 8}
    assert head_counts(SimpleNamespace(config=SimpleNamespace(num_attention_heads=12))) == \
        {"attention heads": 12, "KV heads": 12}  # no KV count: one per head
    # Swin gives one count per stage of the model (a list, once a raw TypeError)
    assert head_counts(SimpleNamespace(config=SimpleNamespace(num_attention_heads=[3, 6]))) == {
        "attention heads of stage 0": 3, "attention heads of stage 1": 6,
        "KV heads of stage 0": 3, "KV heads of stage 1": 6}
    assert head_counts(SimpleNamespace()) == {}
