"""pipecut.runtime.state.weights: where a stage's weights come from, read tensor by tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pipecut.errors import InputError
from pipecut.runtime.state.weights import INDEX_FILE, SINGLE_FILE, open_weights

CPU = torch.device("cpu")


def tensors():
    return {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(2), "c": torch.zeros(1)}


def read_all(source, keys):
    return {k: v for k, v in source.read(keys, CPU)}


def test_a_state_dict_and_a_single_file(tmp_path):
    sd = tensors()
    source = open_weights(sd)
    assert source.keys == frozenset(sd)
    assert read_all(source, ["b.bias"])["b.bias"] is sd["b.bias"]
    path = tmp_path / "w.safetensors"
    save_file(sd, str(path))
    source = open_weights(path)
    assert source.keys == frozenset(sd) and source.where("c") == str(path)
    got = read_all(source, ["a.weight", "c"])
    assert set(got) == {"a.weight", "c"} and torch.equal(got["a.weight"], sd["a.weight"])


def test_save_pretrained_directories_single_sharded_and_indexed(tmp_path):
    sd = tensors()
    single = tmp_path / "single"
    single.mkdir()
    save_file(sd, str(single / SINGLE_FILE))
    assert open_weights(single).keys == frozenset(sd)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a.weight": sd["a.weight"]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b.bias": sd["b.bias"], "c": sd["c"]}, str(sharded / "model-00002-of-00002.safetensors"))
    source = open_weights(sharded)
    assert source.where("c").endswith("model-00002-of-00002.safetensors")
    assert torch.equal(read_all(source, ["c", "a.weight"])["a.weight"], sd["a.weight"])

    (sharded / INDEX_FILE).write_text(json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}))
    assert open_weights(sharded).keys == frozenset({"a.weight"})  # the index says what is there
    (sharded / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(InputError, match="has no 'weight_map'; is it a safetensors index"):
        open_weights(sharded)


def test_what_is_not_weights_is_refused_with_the_options(tmp_path):
    with pytest.raises(InputError, match=r"state dict entries \['n'\] are not tensors"):
        open_weights({"n": 3})
    with pytest.raises(InputError, match=r"weights must be a path .* or a state dict, got int"):
        open_weights(3)
    with pytest.raises(InputError, match="does not exist"):
        open_weights(tmp_path / "nothing")
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(InputError, match=r"is not a .safetensors file"):
        open_weights(tmp_path / "model.bin")
    with pytest.raises(InputError, match=r"holds no safetensors files .* \['model.bin'\]\); save with save_pretrained"):
        open_weights(tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InputError, match=r"cannot read .*bad.safetensors as safetensors"):
        open_weights(tmp_path / "bad.safetensors")
