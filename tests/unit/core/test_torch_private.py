"""pipecut.core.torch_private: the one home of private torch names, and the check that keeps it so.

Issue 41: torch 2.14 removed ``torch.fx._symbolic_trace._is_fx_tracing_flag``, which
``pipecut.capture.bound.torch_state`` read directly, and every torch.export capture failed with::

    AttributeError: module 'torch.fx._symbolic_trace' has no attribute '_is_fx_tracing_flag'

The walk below fails on any private torch name outside ``compiler/core/torch_private.py``; the
fallback tests take each checked name away and see pipecut's behaviour stay.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import operator
import re
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

import pipecut.core.torch_private as tp
from pipecut.capture.bound import check_unchanged, torch_state

ROOT = Path(__file__).resolve().parents[3]
FOLDERS = ("compiler", "passes", "runtime")
HOME = ROOT / "compiler" / "core" / "torch_private.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every private torch name in ``source``: in a torch import (its module
    path or an imported name), in an attribute chain rooted at ``torch`` or at a name a torch
    import bound (``dist`` of ``import torch.distributed as dist``), or as the literal name in
    ``getattr``/``hasattr`` on such a chain. Chains into ``torch.ops`` are op names, not API."""
    tree = ast.parse(source)
    roots = {"torch": "torch"}  # local name -> the torch path it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    roots[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    if any(_private(p) for p in alias.name.split(".")):
                        found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                roots[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            names = [a.name for a in node.names]
            if any(_private(p) for p in [*node.module.split("."), *names]):
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))

    def resolved(chain: list[str] | None) -> list[str] | None:
        if not chain or chain[0] not in roots:
            return None
        return [*roots[chain[0]].split("."), *chain[1:]]

    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            path = resolved(_chain(node))
            if path and path[:2] != ["torch", "ops"] and any(_private(p) for p in path):
                found.append((node.lineno, ".".join(path)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            path = resolved(_chain(node.args[0]))
            if path and _private(node.args[1].value):
                found.append((node.lineno, f"{node.func.id}({'.'.join(path)}, {node.args[1].value!r})"))
    return sorted(found)


def test_no_package_module_uses_a_private_torch_name_but_torch_private() -> None:
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py")) if p != HOME]
    assert len(files) > 50  # the walk reads the package, not an empty folder
    uses = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in files for line, what in private_uses(p.read_text())]
    assert not uses, (
        "private torch names outside compiler/core/torch_private.py (import them from "
        "pipecut.core.torch_private, behind a check there):\n" + "\n".join(uses))


def test_the_walk_finds_each_kind_of_private_use() -> None:
    source = """
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch import _C
from torch.fx.node import _get_qualified_name
n = torch._C._len_torch_dispatch_stack()
torch.cuda._sleep(10)
store = dist.distributed_c10d._get_default_store()
sleep = getattr(torch.cuda, "_sleep", None)
op = torch.ops.aten._to_copy.default
version = torch.__version__
node = torch.fx.Node
module._parameters
"""
    assert private_uses(source) == [
        (4, "import torch.utils._pytree"),
        (5, "from torch._subclasses.fake_tensor import FakeTensorMode"),
        (6, "from torch import _C"),
        (7, "from torch.fx.node import _get_qualified_name"),
        (8, "torch._C._len_torch_dispatch_stack"),
        (9, "torch.cuda._sleep"),
        (10, "torch.distributed.distributed_c10d._get_default_store"),
        (11, "getattr(torch.cuda, '_sleep')"),
    ]


def test_the_names_without_fallback_are_torchs_own() -> None:
    assert tp.pytree is importlib.import_module("torch.utils._pytree")
    fake = importlib.import_module("torch._subclasses.fake_tensor")
    assert (tp.FakeTensor, tp.FakeTensorMode) == (fake.FakeTensor, fake.FakeTensorMode)
    assert fake.log.name == tp.FAKE_TENSOR_LOGGER  # the logger propagate.py quiets
    assert issubclass(tp.DynamicOutputShapeException, Exception)


def test_the_supported_range_is_pyprojects() -> None:
    assert f'"torch{tp.SUPPORTED_TORCH}"' in (ROOT / "pyproject.toml").read_text()


def test_a_torch_without_a_name_pipecut_needs_is_refused_with_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils._pytree", None)
    spec = importlib.util.spec_from_file_location("torch_private_copy", HOME)
    assert spec is not None and spec.loader is not None
    message = (rf"torch.utils._pytree .*torch {re.escape(torch.__version__)} lacks; pipecut supports "
               rf"torch{re.escape(tp.SUPPORTED_TORCH)}")
    with pytest.raises(ImportError, match=message):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_mode_depths_and_transforms_fall_back_to_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    with tp.TorchDispatchMode():
        assert tp.dispatch_mode_depth() == 1
    with torch.overrides.TorchFunctionMode():
        assert tp.function_mode_depth() == 1
    assert torch.func.vmap(lambda x: x * 0 + tp.functorch_transforms_active())(torch.zeros(2)).tolist() == [1, 1]
    for name in ("_len_torch_dispatch_stack", "_len_torch_function_stack", "_are_functorch_transforms_active"):
        monkeypatch.delattr(torch._C, name)
    with tp.TorchDispatchMode():
        assert (tp.dispatch_mode_depth(), tp.function_mode_depth(), tp.functorch_transforms_active()) == (0, 0, False)


class _Records(logging.Handler):
    """The records a logger passes on, kept."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_fx_tracing_is_seen_and_torchs_warning_kept_off_the_log(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(tp.fx_tracing())
            return x + 1

    torch.fx.symbolic_trace(Net())
    assert seen == [True] and tp.fx_tracing() is False
    symbolic = importlib.import_module("torch.fx._symbolic_trace")
    handler = _Records()
    logger = logging.getLogger(symbolic.__name__)
    logger.addHandler(handler)
    try:
        for call in (tp.fx_tracing, symbolic.is_fx_tracing):  # ours is quiet; torch's warns
            symbolic.is_fx_tracing_warning.cache_clear()  # torch warns once a process
            call()
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage().split(" will")[0] for r in handler.records] == ["is_fx_tracing"]
    monkeypatch.delattr(symbolic, "is_fx_tracing")
    assert tp.fx_tracing() is False


def test_tracing_context_is_seen_and_falls_back_to_false(monkeypatch: pytest.MonkeyPatch) -> None:
    guards = importlib.import_module("torch._guards")
    assert not tp.in_tracing_context()
    with guards.tracing(guards.TracingContext(None)):
        assert tp.in_tracing_context()
        with monkeypatch.context() as m:
            m.delattr(guards.TracingContext, "try_get")
            assert not tp.in_tracing_context()


def test_torch_state_reads_on_this_torch_and_without_its_private_names(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch_state()
    assert (before["torch dispatch modes"], before["fx tracing"], before["tracing context"]) == (0, False, False)
    check_unchanged(before, "Net")
    for name in ("_len_torch_dispatch_stack", "_len_torch_function_stack", "_are_functorch_transforms_active"):
        monkeypatch.delattr(torch._C, name)
    monkeypatch.delattr(importlib.import_module("torch.fx._symbolic_trace"), "is_fx_tracing")
    monkeypatch.delattr(importlib.import_module("torch._guards").TracingContext, "try_get")
    check_unchanged(torch_state(), "Net")  # constants: before and after stay equal
    with tp.TorchDispatchMode():
        check_unchanged(before, "Net")


def test_qualified_names_match_torchs_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    targets = (torch.ops.aten.mm.default, torch.ops.aten._to_copy.default, operator.add, torch.relu,
               getattr, torch.Tensor.add)
    names = [tp.qualified_name(t) for t in targets]
    assert names[:3] == ["torch.ops.aten.mm.default", "torch.ops.aten._to_copy.default", "_operator.add"]
    monkeypatch.delattr(importlib.import_module("torch.fx.node"), "_get_qualified_name")
    assert [tp.qualified_name(t) for t in targets] == names


def test_foreach_norm_falls_back_to_one_norm_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.float64), torch.tensor([3.0, -4.0])]
    for ord in (2.0, 1.0, float("inf")):
        fused = tp.foreach_norm(tensors, ord)
        with monkeypatch.context() as m:
            m.delattr(torch, "_foreach_norm")
            alone = tp.foreach_norm(tensors, ord)
        assert [x.dtype for x in alone] == [x.dtype for x in fused]
        torch.testing.assert_close(alone, fused)
    assert tp.foreach_norm(tensors[2:], 2.0)[0].item() == 5.0


def test_cuda_sleep_is_none_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tp.cuda_sleep() is getattr(torch.cuda, "_sleep", None)
    monkeypatch.delattr(torch.cuda, "_sleep", raising=False)
    assert tp.cuda_sleep() is None


def test_inductor_cache_hits_read_the_counters_and_fall_back_to_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = {"inductor": Counter(fxgraph_cache_hit=3)}
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", types.SimpleNamespace(counters=counters))
    assert tp.inductor_cache_hits() == 3
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", None)
    assert tp.inductor_cache_hits() == 0


def test_no_inductor_backend_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch._dynamo", None)
    with pytest.raises(ImportError, match=r"lacks.*compile_stages=False"):
        tp.inductor_backend()


def test_replicate_with_fsdp_and_the_default_store_fall_back_to_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tp.default_store() is None  # no process group here
    has_replicate = importlib.util.find_spec("torch.distributed._composable.replicate_with_fsdp") is not None
    assert callable(tp.replicate_with_fsdp()) is has_replicate
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.replicate_with_fsdp", None)
    assert tp.replicate_with_fsdp() is None
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", None)
    assert tp.default_store() is None
