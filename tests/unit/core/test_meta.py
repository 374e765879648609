"""Meta-device models without processes: capture, planning, and filling a model's tensors from
every kind of weight source, with the errors those promise."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

import pipecut
from examples import mlp, zoo
from pipecut.capture import capture, fingerprint
from pipecut.core.meta import is_meta, module_tensors, to_meta
from pipecut.errors import InputError
from pipecut.profile.nodes import profile
from pipecut.runtime.state.materialize import check_unexpected, materialize_model, materialize_stage
from pipecut.runtime.state.weights import open_weights

CPU = torch.device("cpu")


def _gpt2():
    """GPT-2 with eager attention, real and on meta. Not transformers' default (SDPA): on CPU
    its fused kernel returns the heads' output in a layout whose ``.contiguous()`` export drops,
    while the meta kernel's layout keeps it, so a meta capture has one ``aten.contiguous`` more
    per layer and another fingerprint (a plan made on meta is refused against the real model's
    capture: docs/big-models.md). The comparison here is of everything else."""
    from transformers import GPT2LMHeadModel

    plain, inputs, loss_fn, target = zoo.gpt2(batch_size=4, seed=0, attention="eager")
    with torch.device("meta"):
        meta = GPT2LMHeadModel(plain.config)
    return plain, meta, inputs, loss_fn, target


def _fill(meta: nn.Module, weights, init=None) -> nn.Module:
    """Materialise the whole of ``meta`` (as if it were one stage) from ``weights``."""
    stage = copy.deepcopy(meta)
    source = open_weights(weights) if weights is not None else None
    materialize_stage(stage, (), meta, device=CPU, source=source, init=init, seed=0, where="stage 0 (rank 0)")
    return stage


def test_meta_gpt2_captures_like_the_real_one_and_plans():
    plain, meta, inputs, loss_fn, target = _gpt2()
    plan = pipecut.plan(
        meta, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
    )
    captured = capture(plain, {"input_ids": inputs["input_ids"][:2]})
    assert plan.fingerprint == fingerprint(captured.gm)  # device constants rewritten from meta
    assert "meta model" in plan.solver.detail
    real = profile(captured, captured.flatten_inputs({"input_ids": inputs["input_ids"][:2]}),
                   loss_fn=loss_fn, target=target[:2], repeats=1, warmup=0)
    assert [(n.name, n.output_bytes, n.param_bytes, n.shape) for n in plan.nodes] == [
        (n.name, n.output_bytes, n.param_bytes, n.shape) for n in real
    ]
    assert all(n.forward_ms > 0 for n in plan.nodes if n.op.value == "call_function" and n.param_bytes)
    assert all(is_meta(t) for _, t in module_tensors(meta)), "planning must leave the model on meta"


def test_sharded_save_pretrained_dir_fills_tied_weights(tmp_path):
    plain, meta, *_ = _gpt2()
    plain.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    source = open_weights(tmp_path)
    assert "transformer.wte.weight" in source.keys and "lm_head.weight" not in source.keys
    check_unexpected(source, meta)
    filled = _fill(meta, tmp_path)
    assert filled.lm_head.weight is filled.transformer.wte.weight  # still tied
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(filled.state_dict()[name], value, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_and_state_dict_sources(tmp_path):
    plain = mlp.MLP(16, 2)
    with torch.device("meta"):
        meta = mlp.MLP(16, 2)
    dcp.save({f"model.{k}": v for k, v in plain.state_dict().items()}, checkpoint_id=tmp_path, no_dist=True)
    for weights in (tmp_path, plain.state_dict()):
        filled = _fill(meta, weights)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(filled.state_dict()[name], value, rtol=0, atol=0)


def test_a_real_model_given_weights_is_overwritten_in_place():
    source, target = mlp.MLP(16, 2), mlp.MLP(16, 2)
    weight = target.head.weight
    materialize_stage(target, (), target, device=CPU, source=open_weights(source.state_dict()),
                      init=None, seed=0, where="stage 0 (rank 0)")
    assert target.head.weight is weight  # same tensor objects, new values
    for name, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[name], value, rtol=0, atol=0)


def test_init_is_per_module_seeded_and_leaves_the_model_alone():
    with torch.device("meta"):
        meta = mlp.MLP(16, 2)
    a, b = materialize_model(meta, seed=1), materialize_model(meta, seed=1)
    c = materialize_model(meta, seed=2)
    for name, value in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[name], value, rtol=0, atol=0)
        assert not torch.equal(c.state_dict()[name], value)
    assert all(is_meta(t) for _, t in module_tensors(meta))


def test_missing_tensor_names_it_and_the_stage():
    plain = mlp.MLP(16, 2)
    with torch.device("meta"):
        meta = mlp.MLP(16, 2)
    weights = {k: v for k, v in plain.state_dict().items() if k != "head.bias"}
    with pytest.raises(InputError, match=r"stage 0 \(rank 0\): weights .* lack 1 tensor.*'head.bias'"):
        _fill(meta, weights)


def test_misshaped_and_wrong_dtype_tensors_name_the_file(tmp_path):
    plain = mlp.MLP(16, 2)
    with torch.device("meta"):
        meta = mlp.MLP(16, 2)
    state = dict(plain.state_dict())
    state["head.weight"] = torch.zeros(3, 16)
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(InputError, match=r"stage 0 .*'head.weight' in .*bad.safetensors has shape \(3, 16\)"):
        _fill(meta, tmp_path / "bad.safetensors")
    state = {k: v.double() if k == "head.bias" else v for k, v in plain.state_dict().items()}
    with pytest.raises(InputError, match=r"'head.bias' .* is torch.float64, the model's 'head.bias' is torch.float32"):
        _fill(meta, state)


def test_unexpected_tensor_is_refused():
    plain = mlp.MLP(16, 2)
    state = {**plain.state_dict(), "decoder.weight": torch.zeros(2)}
    with pytest.raises(InputError, match=r"1 tensor\(s\) the model has no parameter or buffer for.*decoder.weight"):
        check_unexpected(open_weights(state), plain)


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.inv_freq


def test_meta_without_weights_or_reset_parameters_lists_the_modules():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _NoReset())
    with pytest.raises(InputError, match=r"no reset_parameters\(\).*'1 \(_NoReset\)'.*init="):
        _fill(model, None)
    filled = _fill(model, None, init=lambda fqn, m: nn.init.ones_(m.scale) if fqn == "1" else m.reset_parameters())
    torch.testing.assert_close(filled[1].scale, torch.ones(4), rtol=0, atol=0)


class _RotaryReset(_Rotary):
    def reset_parameters(self) -> None:
        self.lin.reset_parameters()  # and forgets inv_freq


def test_non_persistent_buffer_on_meta_needs_init_or_weights():
    with torch.device("meta"):
        model, resets = _Rotary(), _RotaryReset()
    with pytest.raises(InputError, match=r"no reset_parameters.*non-persistent buffers \['inv_freq'\]"):
        _fill(model, None)
    with pytest.raises(InputError, match=r"left \['inv_freq'\] unset.*non-persistent buffers"):
        _fill(resets, None)

    def init(fqn, m):
        if fqn == "":
            m.inv_freq.copy_(torch.arange(4.0))
        else:
            m.reset_parameters()

    torch.testing.assert_close(_fill(model, None, init=init).inv_freq, torch.arange(4.0), rtol=0, atol=0)
    real = _Rotary()
    filled = _fill(model, {**real.state_dict(), "inv_freq": torch.arange(4.0)})
    torch.testing.assert_close(filled.inv_freq, torch.arange(4.0), rtol=0, atol=0)


def test_bad_weight_paths(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        open_weights(tmp_path / "nope.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(InputError, match=r"holds no safetensors files.*pytorch_model.bin"):
        open_weights(tmp_path)


def test_profiling_a_meta_model_never_holds_more_than_a_node_of_scratch_weights(monkeypatch):
    """Count the bytes of scratch weights alive at once while rank 0 plans a meta model: one
    Linear's worth (plus its bias) at a time, never the whole model. (Before the autograd
    history of each scratch node was cut, every scratch weight stayed alive to the end.)"""
    import weakref

    import pipecut.core.meta

    live, peak = [0], [0]
    made = pipecut.core.meta.real_like

    def counted(t, device, generator=None):
        value = made(t, device, generator)
        nbytes = value.numel() * value.element_size()
        live[0] += nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(value, lambda: live.__setitem__(0, live[0] - nbytes))
        return value

    monkeypatch.setattr(pipecut.core.meta, "real_like", counted)
    _, inputs, loss_fn, target = mlp.build(batch_size=8, seed=0, width=64, depth=8)
    with torch.device("meta"):
        model = mlp.MLP(64, 8)
    pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
    )
    layer = (64 * 64 + 64) * 4
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak[0] > 0, "the profiler made no scratch weights: the test measures nothing"
    assert peak[0] <= layer, (peak[0], layer, total)


def test_estimated_costs_of_a_meta_model_equal_the_real_models():
    plain, inputs, loss_fn, target = mlp.build(batch_size=8, seed=0, width=64, depth=3)
    with torch.device("meta"):
        meta = mlp.MLP(64, 3)
    got = pipecut.estimate_costs(meta, inputs, "A100-80GB", microbatches=2, loss_fn=loss_fn, target=target)
    want = pipecut.estimate_costs(plain, inputs, "A100-80GB", microbatches=2, loss_fn=loss_fn, target=target)
    assert [(n.name, n.forward_ms, n.backward_ms, n.source) for n in got] == [
        (n.name, n.forward_ms, n.backward_ms, n.source) for n in want
    ]
    assert any(n.forward_ms > 0 for n in got)


def test_an_explicit_init_is_used_for_hugging_face_models_too(tmp_path):
    """Without init=, a Hugging Face model computes what no checkpoint holds as from_pretrained
    does (tests/unit/runtime/state/test_pretrained.py); an init= given is used instead, as for any model."""
    plain, inputs, *_ = zoo.llama(batch_size=2)
    plain.save_pretrained(tmp_path)
    with torch.device("meta"):
        meta = type(plain)(plain.config)
    calls = []
    filled = _fill(meta, tmp_path, init=lambda fqn, m: (calls.append(fqn), meta._init_weights(m)))
    assert calls == ["model.rotary_emb"]
    for name, value in plain.named_buffers():
        torch.testing.assert_close(dict(filled.named_buffers())[name], value, rtol=0, atol=0)
    with torch.no_grad():  # same weights, same eager code: identical
        torch.testing.assert_close(filled(**inputs).logits, plain(**inputs).logits, rtol=0, atol=0)


def test_scratch_copies_real_tensors_from_another_device_and_puts_them_back():
    from pipecut.core.meta import read_by, scratch

    model = torch.nn.Linear(3, 2)
    weight, bias = model.weight, model.bias
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(model))
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    tensors = read_by(node, gm, ((), {}))
    with scratch(gm, tensors, torch.device("cpu")) as real:  # already there: nothing is copied
        assert real == {}
    with scratch(gm, tensors, torch.device("meta")) as real:
        inner = gm.get_submodule(str(node.target))
        assert set(real) == {id(weight), id(bias)}
        assert inner.weight.device.type == "meta" and isinstance(inner.weight, torch.nn.Parameter)
        assert inner.weight.requires_grad
    assert inner.weight is weight and inner.bias is bias


def test_to_meta_keeps_shape_and_requires_grad_but_no_autograd_history() -> None:
    """Every node's arguments are kept as meta stand-ins in case a later node must be estimated:
    with their autograd history they would keep every real activation alive to the end."""
    x = torch.randn(4, 3, requires_grad=True) * 2
    meta = to_meta(x)
    assert meta.device.type == "meta" and meta.shape == x.shape and meta.grad_fn is None
    assert meta.requires_grad and not to_meta(torch.ones(2)).requires_grad and to_meta(3) == 3
