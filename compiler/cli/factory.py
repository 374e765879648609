"""``MODULE:FACTORY`` specs: how the CLI finds the model to plan.

A factory is a function returning ``(model, example_inputs, loss_fn, target)`` — exactly what
``pipecut.plan`` takes. It may accept ``batch_size`` and ``seed`` keywords; the CLI passes them
when given. MODULE is a dotted module importable from the current directory
(``examples.gpt:build``) or a path to a Python file (``examples/gpt.py:build``)::

    # mymodel.py
    def build(batch_size=16, seed=0):
        torch.manual_seed(seed)
        model = MyModel()
        x, y = torch.randn(batch_size, 128), torch.randint(0, 10, (batch_size,))
        return model, (x,), torch.nn.functional.cross_entropy, y

    $ pipecut plan mymodel.py:build --devices 4 --microbatches 8 --out plan.json
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipecut.errors import InputError

__all__ = ["SHIPPED", "Example", "call_factory", "load_factory"]

SHIPPED = ("examples.mlp:build", "examples.gpt:build", "examples.resnet:build")
"""Factories of the example models in this repository."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    """What a factory returns, named."""

    model: torch.nn.Module
    inputs: Any
    loss_fn: Callable[..., Any] | None
    target: Any


def _import(module: str) -> Any:
    path = Path(module)
    if module.endswith(".py") or path.is_file():
        if not path.is_file():
            raise InputError(f"factory file {module!r} does not exist (relative to {Path.cwd()})")
        name = f"pipecut_factory_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise InputError(f"cannot load {module!r} as a Python file")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses and pickling look the module up by name
        spec.loader.exec_module(mod)
        return mod
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # like `python -m`: modules next to the user are importable
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise InputError(
            f"cannot import module {module!r} ({e}); give a dotted module importable from "
            f"{cwd} or a path to a .py file, e.g. examples.gpt:build or examples/gpt.py:build"
        ) from e


def load_factory(spec: str) -> Callable[..., Any]:
    """The function named by ``MODULE:FACTORY``."""
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name:
        raise InputError(
            f"expected MODULE:FACTORY, got {spec!r}; for example {', '.join(SHIPPED)}"
        )
    mod = _import(module)
    fn = getattr(mod, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(mod).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise InputError(f"{module} has no function {name!r}; its functions are {found}")
    return fn


def call_factory(fn: Callable[..., Any], *, batch_size: int | None = None,
                 seed: int | None = None, spec: str = "factory") -> Example:
    """Call a factory with the keywords it accepts and check what it returns."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {}
    for key, value in (("batch_size", batch_size), ("seed", seed)):
        if value is None:
            continue
        if key not in params and not takes_any:
            raise InputError(f"{spec} does not take {key}=; drop --{key.replace('_', '-')} or add the parameter")
        kwargs[key] = value
    out = fn(**kwargs)
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 4):
        raise InputError(
            f"{spec} must return (model, example_inputs, loss_fn, target), got "
            f"{type(out).__name__}{f' of {len(out)}' if isinstance(out, (tuple, list)) else ''}"
        )
    model, inputs, loss_fn, target = (*out, None, None) if len(out) == 2 else out
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"{spec} returned {type(model).__name__} as the model; expected a torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return Example(model=model, inputs=inputs, loss_fn=loss_fn, target=target)
