"""Real model families, built from Hugging Face configs with random weights (nothing downloaded).

Each factory is ``name(batch_size=8, seed=0) -> (model, inputs, loss_fn, target)`` like the
other examples, with small sizes (2 layers, hidden 64) and every dropout at 0 so a pipelined
run can be compared exactly with the plain model. Attention is transformers' default, what a
user who builds the model gets (SDPA where the model has it); ``attention="eager"`` (or any
``attn_implementation``) builds another, for the sweeps' eager column. The key/value cache is
the config's default too (on for the causal LMs: capture exports without it). The Hugging Face factories also take
``layers=`` (default 2), which :mod:`examples.architectures` sets to the issue 27 sweep's 4. The loss functions take the model's
``ModelOutput``. :data:`ZOO` maps a name to its factory, for tests, the CLI and benchmarks.

Each model exercises something the toy examples do not:

========  ==========================================================================
resnet    BatchNorm buffers updated in training mode, ``ModelOutput`` output
vit       patch embedding, CLS token parameter, position embeddings
gpt2      tied input/output embeddings (one weight on two stages), keyword input
bert      keyword inputs ``input_ids`` + ``attention_mask``, tied MLM decoder
llama     rotary embeddings (a non-persistent ``inv_freq`` buffer), grouped-query attention
qwen2     rotary embeddings with attention biases
t5        encoder-decoder with two inputs; the encoder output crosses into the decoder
tagger    captured by symbolic_trace: dict output, ``torch.Size`` and ints crossing cuts
========  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pipecut
from pipecut.core.batching import split_microbatches

Built = tuple[nn.Module, Any, Callable[[Any, Any], torch.Tensor], torch.Tensor]

VOCAB = 128
SEQ = 16
HIDDEN = 64
LAYERS = 2
HEADS = 4
IMAGE = 32
CLASSES = 10


def attention_settings(attention: str | None) -> dict[str, str]:
    """Config keywords for an attention implementation: none for None, so the model gets
    transformers' default as a user's does; ``{"attn_implementation": attention}`` otherwise."""
    return {} if attention is None else {"attn_implementation": attention}


def logits_ce(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``out.logits`` (any leading dims) against integer targets."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _tokens(batch_size: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _images(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (batch_size,))


def resnet(batch_size: int = 8, seed: int = 0, layers: int = LAYERS, attention: str | None = None) -> Built:
    """``attention`` is taken like the other factories' and unused: a ResNet has none."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    config = ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[layers // 2, layers - layers // 2],
        layer_type="basic", num_labels=CLASSES,
    )
    model = ResNetForImageClassification(config)
    x, y = _images(batch_size)
    return model, {"pixel_values": x}, logits_ce, y


def vit(batch_size: int = 8, seed: int = 0, layers: int = LAYERS, attention: str | None = None) -> Built:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, image_size=IMAGE, patch_size=8, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **attention_settings(attention),
    )
    model = ViTForImageClassification(config)
    x, y = _images(batch_size)
    return model, {"pixel_values": x}, logits_ce, y


def gpt2(batch_size: int = 8, seed: int = 0, layers: int = LAYERS, attention: str | None = None) -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        bos_token_id=0, eos_token_id=0, **attention_settings(attention),
    )
    model = GPT2LMHeadModel(config)
    ids, target = _tokens(batch_size)
    return model, {"input_ids": ids}, logits_ce, target


def bert(batch_size: int = 8, seed: int = 0, layers: int = LAYERS, attention: str | None = None) -> Built:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **attention_settings(attention),
    )
    model = BertForMaskedLM(config)
    ids, target = _tokens(batch_size)
    mask = torch.ones_like(ids)
    mask[: batch_size // 2, SEQ - 4 :] = 0  # some padding, so the mask matters
    return model, {"input_ids": ids, "attention_mask": mask}, logits_ce, target


def llama(batch_size: int = 8, seed: int = 0, layers: int = LAYERS, attention: str | None = None) -> Built:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
        max_position_embeddings=SEQ, attention_dropout=0.0,
        **attention_settings(attention),
    )
    model = LlamaForCausalLM(config)
    ids, target = _tokens(batch_size)
    return model, {"input_ids": ids}, logits_ce, target


def qwen2(batch_size: int = 8, seed: int = 0, layers: int = LAYERS, attention: str | None = None) -> Built:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
        max_position_embeddings=SEQ, attention_dropout=0.0,
        **attention_settings(attention),
    )
    model = Qwen2ForCausalLM(config)
    ids, target = _tokens(batch_size)
    return model, {"input_ids": ids}, logits_ce, target


def t5(batch_size: int = 8, seed: int = 0, layers: int = LAYERS, attention: str | None = None) -> Built:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN,
        num_layers=layers, num_decoder_layers=layers, num_heads=HEADS, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
        **attention_settings(attention),
    )
    model = T5ForConditionalGeneration(config)
    src = torch.randint(1, VOCAB, (batch_size, SEQ))
    labels = torch.randint(1, VOCAB, (batch_size, SEQ))
    decoder_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
    inputs = {"input_ids": src, "decoder_input_ids": decoder_ids}
    return model, inputs, logits_ce, labels


class Tagger(nn.Module):
    """A token tagger that ``torch.fx.symbolic_trace`` captures (no Hugging Face code).

    Keyword inputs, a dict output, BatchNorm and a constant buffer; the batch shape is read at
    the start and used at the end, so a ``torch.Size`` and ints cross every cut.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
            for _ in range(LAYERS)
        )
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.register_buffer("scale", torch.tensor(HIDDEN**-0.5))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        shape = tokens.shape
        batch, seq = tokens.size(0), tokens.size(1)
        x = self.embed(tokens) * mask.unsqueeze(-1)
        for layer in self.layers:
            x = x + layer(x) * self.scale
        x = self.norm(x.reshape(batch * seq, HIDDEN))
        logits = self.head(x).reshape(shape + (CLASSES,))  # noqa: RUF005 - a Proxy has no len for *
        return {"logits": logits, "pooled": x.reshape(batch, seq, HIDDEN).mean(1)}


def tagger(batch_size: int = 8, seed: int = 0) -> Built:
    torch.manual_seed(seed)
    model = Tagger()
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ))
    mask = (torch.rand(batch_size, SEQ) > 0.2).float()
    target = torch.randint(0, CLASSES, (batch_size, SEQ))
    return model, {"tokens": tokens, "mask": mask}, dict_logits_ce, target


def dict_logits_ce(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"].flatten(0, 1), target.flatten())


ZOO: dict[str, Callable[..., Built]] = {
    "resnet": resnet,
    "vit": vit,
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "qwen2": qwen2,
    "t5": t5,
    "tagger": tagger,
}
"""Factories by name: ``ZOO["gpt2"](batch_size=8, seed=0)``."""


def tv_resnet18(batch_size: int = 8, seed: int = 0) -> Built:
    """torchvision's ResNet-18 (BatchNorm, in-place ReLU and ``+=``), random weights."""
    from torchvision.models import resnet18

    torch.manual_seed(seed)
    model = resnet18(weights=None, num_classes=CLASSES)
    x, y = _images(batch_size)
    return model, (x,), F.cross_entropy, y


def tv_vit(batch_size: int = 8, seed: int = 0) -> Built:
    """torchvision's VisionTransformer built from a small config, random weights."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(image_size=IMAGE, patch_size=8, num_layers=2, num_heads=2,
                              hidden_dim=64, mlp_dim=128, num_classes=CLASSES)
    x, y = _images(batch_size)
    return model, (x,), F.cross_entropy, y


VISION: dict[str, Callable[..., Built]] = {"tv_resnet18": tv_resnet18, "tv_vit": tv_vit}
"""torchvision models: in ZOO only where torchvision imports (not beside torch 2.13.0, whose
CPU build it does not match; see the README for the torch 2.14.1 + torchvision set-up)."""
try:
    import torchvision  # noqa: F401

    ZOO.update(VISION)
except Exception:  # not installed, or built for another torch
    pass



# --- parity: a pipelined step against the plain model ---------------------------------------


Factories = Mapping[str, Callable[..., Built]]


def factory(name: str, models: Factories | None = None) -> Callable[..., Built]:
    """The factory registered as ``name`` in ``models`` (None: :data:`ZOO`).

    :data:`ZOO` (2 layers) and :data:`examples.architectures.ARCHITECTURES` (4 layers) share
    names such as ``vit``, so the registry is chosen explicitly rather than guessed.
    """
    models = ZOO if models is None else models
    if name not in models:
        raise KeyError(f"no model {name!r} in this registry; choose one of {sorted(models)} (the "
                       f"issue 27 sweep's are in examples.architectures.ARCHITECTURES)")
    return models[name]


def stages_per_rank_of(kind: pipecut.ScheduleKind) -> int:
    """The stages each rank runs in the parity checks: ZBV's fixed 2, 2 for interleaved 1F1B
    (the smallest count that interleaves), else 1."""
    if kind.fixed_stages_per_rank is not None:
        return kind.fixed_stages_per_rank
    return 2 if kind is pipecut.ScheduleKind.INTERLEAVED_1F1B else 1


def pipelined_step(rank: int, world: int, name: str, microbatches: int, batch_size: int = 8,
                   seed: int = 0, timeout: float = 60.0, schedule: str | pipecut.ScheduleKind = "gpipe",
                   *, models: Factories | None = None, plan: Any = None,
                   measure: pipecut.MeasureOptions | None = None, devices: Any = None,
                   tensor_parallel: pipecut.TensorParallelOptions | None = None,
                   data_parallel: str | None = None, compile_stages: bool = False) -> dict[str, Any]:
    """On one rank: compile model ``name`` of ``models`` over ``world`` ranks, run one step.

    ``schedule``: any :class:`pipecut.ScheduleKind` or its name (interleaved 1F1B and ZBV with
    2 stages per rank). ``plan``: replay this plan instead of planning on rank 0 (a parity
    test pins its split and schedule with :func:`examples.pinned.fixed_plan`). ``measure``: how
    rank 0 plans without one (default: counted costs priced on a fixed device profile, no clock
    and no calibration, so the split, and with it the order in which gradients are summed, is
    the same on every run; ``MeasureOptions()`` plans as a user's ``compile`` does, from
    timings, calibrated on the running pipeline). ``devices``: instead of ``world`` ranks, a
    DeviceMesh (a "tp" dimension splits the stages; ``tensor_parallel`` how; a "dp" dimension
    holds replicas, each stepping its share of the batch, kept in step by ``data_parallel``,
    "ddp" or "fsdp"). ``compile_stages``: the stages run through torch.compile. Returns what
    the parity check compares: the loss, this rank's gradients (whole: a split or sharded one
    gathered over its group) and buffers under the model's names, and how the model was captured.
    """
    kind = pipecut.ScheduleKind(schedule)
    model, inputs, loss_fn, target = factory(name, models)(batch_size=batch_size, seed=seed)
    if devices is not None and "dp" in (devices.mesh_dim_names or ()):
        replicas, replica = devices["dp"].size(), devices.get_local_rank("dp")
        inputs = split_microbatches(inputs, replicas, batch_size)[replica]
        target = split_microbatches(target, replicas, batch_size, "target")[replica]
    pipe = pipecut.compile(
        model, inputs, world if devices is None else devices, loss_fn=loss_fn, target=target, plan=plan,
        microbatches=microbatches, schedule=kind, tensor_parallel=tensor_parallel, data_parallel=data_parallel,
        scheduling=pipecut.ScheduleOptions(stages_per_rank=stages_per_rank_of(kind)),
        runtime=pipecut.RuntimeOptions(timeout=timeout, compile_stages=compile_stages),
        measure=measure if measure is not None else pipecut.MeasureOptions(estimate="A100-80GB"),
    )
    loss = pipe.step(inputs, target)
    return {
        "loss": loss,
        "grads": {n: whole_copy(p.grad) for n, p in pipe.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in pipe.named_buffers()},
        "capture": pipe.plan.capture.value,
        "stages": [len(s.nodes) for s in pipe.plan.stages],
        "cut_constants": cut_constants(pipe.plan),
    }


def whole_copy(t: torch.Tensor) -> torch.Tensor:
    """A gradient as one plain tensor: a DTensor's gathered over its group (collective: every
    rank of the group walks its parameters in the same order)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def cut_constants(plan: Any) -> int:
    """How many non-tensor leaves (sizes, ints, dtypes…) cross a cut in ``plan``."""
    from pipecut.core.kinds import LeafKind

    return sum(
        leaf.kind is LeafKind.CONSTANT
        for stage in plan.stages for name in stage.inputs for leaf in plan.node(name).leaves
    )


def reference_step(name: str, microbatches: int, batch_size: int = 8, seed: int = 0,
                   *, models: Factories | None = None) -> tuple[torch.Tensor, nn.Module]:
    """The plain model's step: mean over microbatches of the loss, backward per microbatch.

    Microbatch by microbatch, as the pipeline runs it, so BatchNorm sees the same batches and
    updates its running statistics the same number of times.
    """
    from pipecut.core.batching import split_microbatches

    model, inputs, loss_fn, target = factory(name, models)(batch_size=batch_size, seed=seed)
    total = torch.zeros(())
    mbs = split_microbatches(inputs, microbatches, batch_size)
    targets = split_microbatches(target, microbatches, batch_size, "target")
    for mb, t in zip(mbs, targets):
        out = model(**mb) if isinstance(mb, dict) else model(*mb)
        loss = loss_fn(out, t) / microbatches
        loss.backward()
        total += loss.detach()
    return total, model


def compare(reference: tuple[torch.Tensor, nn.Module], ranks: list[dict[str, Any]],
            atol: float, rtol: float) -> dict[str, Any]:
    """Check every rank's loss, gradients and buffers against the reference; report the errors.

    Raises ``AssertionError`` naming the tensor when one differs beyond the tolerances or a
    reference parameter got no gradient on any rank. The report's ``max_rel`` is normwise:
    the largest ``max|got - want| / max|want|`` over the tensors compared.
    """
    ref_loss, model = reference
    worst = {"max_abs": 0.0, "max_rel": 0.0}

    def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
        if want.is_floating_point() and want.numel():
            diff = (got.double() - want.double()).abs()
            worst["max_abs"] = max(worst["max_abs"], diff.max().item())
            scale = want.double().abs().max().item()
            if scale > 0:
                worst["max_rel"] = max(worst["max_rel"], diff.max().item() / scale)

    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    covered: set[int] = set()
    for rank, result in enumerate(ranks):
        check(result["loss"], ref_loss, f"rank {rank} loss")
        for fqn, grad in result["grads"].items():
            p = params[fqn]
            assert p.grad is not None, f"rank {rank}: {fqn} has a gradient, the reference none"
            check(grad, p.grad, f"rank {rank} grad {fqn}")
            covered.add(id(p))
        for fqn, buf in result["buffers"].items():
            check(buf, buffers[fqn], f"rank {rank} buffer {fqn}")
    missed = sorted({n for n, p in params.items() if p.grad is not None and id(p) not in covered})
    assert not missed, f"parameters with a reference gradient on no rank: {missed}"
    first = ranks[0]
    return {"capture": first["capture"], "stages": first["stages"],
            "cut_constants": first["cut_constants"], **worst}
