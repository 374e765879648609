"""The differential fuzzer's zoo: seven tiny hand-written models, each a shape of model that a
pipeline split must get right, and the transformers architectures of tests/fuzz_real.py (see
:data:`MODELS`).

Each :class:`~tests.fuzz_spec.ModelSpec` builds its model from a seed and its data from (rows,
seed, seq), so the fuzzer can draw as many batches as it likes; every loss ignores target -100
(padding for the summed, token-normalised losses). Sizes are tiny on purpose: one configuration
of a hand-written model compiles and runs 2-3 optimizer steps on several forked ranks in about
a second.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt import GPT
from examples.resnet import ResNet
from tests.fuzz_real import REAL
from tests.fuzz_spec import ModelSpec, seeded

IN = 16
DIM = 32
CLASSES = 8
VOCAB = 64
SEQ = 8
TOKENS = 4  # positions per sample of the MoE model (tokens are routed one by one)


def ce(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=-100, reduction=reduction)


def ce_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ce(logits, target, "sum")


def dict_loss(out: dict[str, torch.Tensor], target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` plus a per-row auxiliary term (mean or sum over rows)."""
    aux = out["aux"].mean() if reduction == "mean" else out["aux"].sum()
    return ce(out["logits"], target, reduction) + 0.1 * aux


def dict_loss_sum(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return dict_loss(out, target, "sum")


class UntiedGPT(GPT):
    """The GPT example with its own output matrix (no weight shared between stages)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.lm_head.weight = nn.Parameter(self.tok_emb.weight.detach().clone() * 0.5)


def _mlp(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh())


class Skip(nn.Module):
    """Skip connections over several stages: the first and second layers' outputs are added
    to the last, so they cross every cut in between."""

    def __init__(self, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.layers = nn.ModuleList(_mlp(DIM) for _ in range(depth))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = self.inp(x)
        h = x0
        first = None
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == 0:
                first = h
        return self.head(h + x0 + 0.5 * first)


class DictIO(nn.Module):
    """Keyword inputs (features and a mask) and a dict output with an auxiliary term."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.layers = nn.ModuleList(_mlp(DIM) for _ in range(depth))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x * mask)
        for layer in self.layers:
            h = h + layer(h)
        return {"logits": self.head(h), "aux": (h * h).mean(-1)}


class Frozen(nn.Module):
    """A frozen input layer and a frozen middle layer (requires_grad False: no ``.grad``, no
    optimizer update), and a detached skip around the middle."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM).requires_grad_(False)
        self.layers = nn.ModuleList(_mlp(DIM) for _ in range(depth))
        self.layers[1].requires_grad_(False)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            h = layer(h) + (h.detach() * 0.5 if i == 2 else 0.0)
        return self.head(h)


class MoE(nn.Module):
    """Top-2 of 4 experts per token, computed densely and weighted by the router's gates (so
    symbolic_trace captures it: the routing is data, not control flow)."""

    def __init__(self, experts: int = 4, top: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)) for _ in range(experts)
        )
        self.top = top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        weight, index = gates.topk(self.top, dim=-1)
        dense = torch.zeros_like(gates).scatter(-1, index, weight)
        out = x
        for e, expert in enumerate(self.experts):
            out = out + dense[..., e : e + 1] * expert(x)
        return out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.pre = _mlp(DIM)
        self.moe = MoE()
        self.post = _mlp(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.post(self.moe(self.pre(self.inp(x))))
        return self.head(h.mean(1))


def _tokens(rows: int, seed: int, seq: int) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


def _features(rows: int, seed: int, seq: int) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, IN, generator=g),), torch.randint(0, CLASSES, (rows,), generator=g)


def _masked(rows: int, seed: int, seq: int) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=g)
    mask = (torch.rand(rows, IN, generator=g) > 0.25).float()
    return {"x": x, "mask": mask}, torch.randint(0, CLASSES, (rows,), generator=g)


def _routed(rows: int, seed: int, seq: int) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, TOKENS, IN, generator=g),), torch.randint(0, CLASSES, (rows,), generator=g)


def _images(rows: int, seed: int, seq: int) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 3, 8, 8, generator=g),), torch.randint(0, CLASSES, (rows,), generator=g)


def _lm_points() -> tuple[str, ...]:
    return (*(p for i in range(4) for p in (f"blocks.{i}", f"blocks.{i}.mlp")), "ln_f", "lm_head")


def _layer_points(depth: int) -> tuple[str, ...]:
    return (*(f"layers.{i}" for i in range(depth)), "head")


_LM = dict(vocab=VOCAB, dim=DIM, heads=2, layers=4, seq=SEQ)

HAND: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(name="tied_lm", model=seeded(lambda: GPT(**_LM)), data=_tokens, loss=ce, loss_sum=ce_sum,
                  split_points=_lm_points(), blocks="blocks", seq=SEQ, head="lm_head",
                  freezable=("tok_emb.weight", "pos_emb", "blocks.2.qkv.weight")),
        ModelSpec(name="untied_lm", model=seeded(lambda: UntiedGPT(**_LM)), data=_tokens, loss=ce,
                  loss_sum=ce_sum, split_points=_lm_points(), blocks="blocks", seq=SEQ, head="lm_head",
                  freezable=("lm_head.weight", "blocks.0.ln1.bias")),
        ModelSpec(name="bn_cnn", model=seeded(lambda: ResNet(widths=(4, 8), blocks=2, classes=CLASSES)),
                  data=_images, loss=ce, loss_sum=ce_sum, batchnorm=True, blocks="layers",
                  split_points=("layers.0", "layers.0.conv2", "layers.1", "layers.2", "layers.2.conv2",
                                "layers.3", "fc"),
                  freezable=("stem.0.weight", "layers.2.bn1.weight", "fc.bias")),
        ModelSpec(name="skip", model=seeded(Skip), data=_features, loss=ce, loss_sum=ce_sum,
                  split_points=_layer_points(6), blocks="layers", freezable=("inp.weight", "layers.0.0.bias")),
        ModelSpec(name="dict_io", model=seeded(DictIO), data=_masked, loss=dict_loss, loss_sum=dict_loss_sum,
                  split_points=_layer_points(4), blocks="layers", freezable=("layers.1.0.weight",)),
        ModelSpec(name="frozen", model=seeded(Frozen), data=_features, loss=ce, loss_sum=ce_sum,
                  split_points=_layer_points(4), blocks="layers", freezable=("layers.0.0.weight", "head.weight")),
        ModelSpec(name="moe", model=seeded(MoENet), data=_routed, loss=ce, loss_sum=ce_sum,
                  split_points=("pre", "moe", "moe.experts.1", "moe.experts.2", "moe.experts.3", "post", "head"),
                  blocks="moe.experts", freezable=("moe.router.weight", "moe.experts.2.0.weight")),
    )
}
"""The hand-written models by name."""

MODELS: dict[str, ModelSpec] = {**HAND, **REAL}
"""The zoo by name: the hand-written models and the transformers architectures."""
