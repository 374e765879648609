"""Tiny models and plans shared by the unit tests (cached: each is built once per session)."""

from __future__ import annotations

import functools
from typing import Any

import pipecut
from examples import mlp
from pipecut.capture import capture
from pipecut.core.program import Captured
from pipecut.ir import Plan

__all__ = ["mlp_captured", "mlp_plan", "tiny_llama"]


def _mlp():  # type: ignore[no-untyped-def]
    return mlp.build(batch_size=8, width=32, depth=4)


@functools.cache
def mlp_plan(stages: int = 3, microbatches: int = 4, schedule: str = "1f1b") -> Plan:
    """A plan of the example MLP (width 32, depth 4) from counted costs on a fixed device
    profile, so that its split is the same on every run: a measured split moved with the
    machine's load (under load one stage once took all but two nodes, and a test that shifts
    a cut found no stage to shift it from)."""
    model, inputs, loss_fn, target = _mlp()
    return pipecut.plan(
        model, inputs, stages, loss_fn=loss_fn, target=target, microbatches=microbatches,
        schedule=schedule, measure=pipecut.MeasureOptions(estimate="A100-80GB"),
    )


@functools.cache
def mlp_captured() -> Captured:
    """The graph :func:`mlp_plan` plans, captured for a microbatch of 2."""
    model, (x,), _, _ = _mlp()
    return capture(model, (x[:2],))


def tiny_llama(heads: int = 2, kv_heads: int = 1, batch: int = 8, seq: int = 16, vocab: int = 100):  # type: ignore[no-untyped-def]
    """A two-layer bf16 Llama (hidden 64) and a batch of token ids, for cluster plans."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab, use_cache=False)
    return LlamaForCausalLM(cfg).to(torch.bfloat16), {"input_ids": torch.zeros(batch, seq, dtype=torch.long)}


class Mesh:
    """Stands for a DeviceMesh: its named dimensions and their sizes (no process group)."""

    def __init__(self, **sizes: int) -> None:
        self.mesh_dim_names = tuple(sizes)
        self._sizes = sizes

    def __getitem__(self, name: str) -> Any:
        return type("Dim", (), {"size": lambda _self: self._sizes[name]})()
