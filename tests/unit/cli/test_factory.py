"""pipecut.cli.factory: MODULE:FACTORY specs and what factories must return."""

from __future__ import annotations

import pytest
import torch

from pipecut.cli.factory import SHIPPED, call_factory, load_factory
from pipecut.errors import InputError


@pytest.mark.parametrize("spec", ["build", ":build", "examples.mlp:", "examples.mlp"])
def test_a_spec_needs_module_and_factory(spec):
    with pytest.raises(InputError, match=f"expected MODULE:FACTORY, got {spec!r}; for example examples.mlp:build"):
        load_factory(spec)


def test_unknown_module_file_and_function_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="cannot import module 'nosuchmodule_x'"):
        load_factory("nosuchmodule_x:build")
    with pytest.raises(InputError, match=r"factory file 'missing.py' does not exist"):
        load_factory("missing.py:build")
    (tmp_path / "mine.py").write_text("def build():\n    pass\n\ndef other():\n    pass\n\n_x = 1\n")
    with pytest.raises(InputError, match=r"mine has no function 'make'; its functions are \['build', 'other'\]"):
        load_factory("mine:make")
    assert load_factory("mine.py:other").__name__ == "other"


def test_shipped_factories_load():
    fn = load_factory(SHIPPED[0])
    example = call_factory(fn, batch_size=4, seed=1)
    assert isinstance(example.model, torch.nn.Module)
    assert example.inputs[0].shape[0] == 4 and example.target.shape == (4,)


def test_call_factory_checks_keywords_and_what_comes_back():
    model = torch.nn.Linear(2, 2)
    example = call_factory(lambda: (model, torch.zeros(1, 2)))
    assert example.model is model and isinstance(example.inputs, tuple) and example.loss_fn is None
    assert call_factory(lambda **kw: (model, (torch.zeros(kw["batch_size"], 2),)), batch_size=3).inputs[0].shape == (3, 2)
    with pytest.raises(InputError, match="f does not take seed=; drop --seed or add the parameter"):
        call_factory(lambda batch_size: (model, ()), seed=1, spec="f")
    with pytest.raises(InputError, match="f must return \\(model, example_inputs, loss_fn, target\\), got tuple of 3"):
        call_factory(lambda: (model, (), None), spec="f")
    with pytest.raises(InputError, match=r"f must return .* got int"):
        call_factory(lambda: 3, spec="f")
    with pytest.raises(InputError, match=r"f returned str as the model; expected a torch.nn.Module"):
        call_factory(lambda: ("m", ()), spec="f")
