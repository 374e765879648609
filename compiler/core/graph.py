"""Small facts about fx nodes shared by profiling, partitioning and splitting."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from pipecut.core.torch_private import qualified_name

__all__ = ["EAGER", "attr_tensor", "canonical_names", "module_path", "mutates_first_arg", "node_parameters", "target_name"]

EAGER = "pipecut_eager"
"""The ``node.meta`` key of a node that runs eagerly when its stage is compiled apart
(:func:`pipecut.runtime.execution.compiled.compile_apart`): a tensor group's region end
(:mod:`pipecut.passes.rewrite.tensor_regions`), a change of DTensor placements that Dynamo
fails to trace (a vocabulary-split embedding's masked partial sum made whole, under fake tensors)."""

_INPLACE_FUNCTIONS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
}


def target_name(node: fx.Node) -> str:
    """A stable, readable name for a node's target."""
    if node.op == "call_function":
        try:
            return qualified_name(node.target)  # type: ignore[arg-type]
        except Exception:
            return getattr(node.target, "__name__", repr(node.target))
    return str(node.target)


def module_path(node: fx.Node) -> str:
    """The innermost module a node came from ('' for the top level)."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return path if isinstance(path, str) else ""
    return ""


def mutates_first_arg(node: fx.Node, root: torch.nn.Module) -> bool:
    """True if the node writes into its first input (``x += y``, ``relu_``, ReLU(inplace=True))."""
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCTIONS or node.kwargs.get("inplace") is True:
            return True
        name = getattr(node.target, "__name__", "")
        overload = getattr(node.target, "_overloadpacket", None)
        if overload is not None:
            name = overload.__name__
        return name.endswith("_") and not name.startswith("_") and not name.endswith("__")
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_module":
        return bool(getattr(root.get_submodule(str(node.target)), "inplace", False))
    return False


def canonical_names(root: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its first fully qualified name (aliases of tied weights share one)."""
    names: dict[int, str] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def attr_tensor(node: fx.Node, root: torch.nn.Module) -> torch.Tensor | None:
    """The parameter or buffer a ``get_attr`` node names; None for anything else."""
    if node.op != "get_attr":
        return None
    for get in (root.get_parameter, root.get_buffer):
        try:
            return get(str(node.target))
        except AttributeError:
            pass
    return None


def node_parameters(node: fx.Node, root: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(FQN, parameter) pairs a node reads directly: a get_attr of a parameter or a module's own."""
    if node.op == "get_attr":
        try:
            value = root.get_parameter(str(node.target))
        except AttributeError:
            return []
        return [(str(node.target), value)]
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        prefix = f"{node.target}."
        return [(prefix + n, p) for n, p in module.named_parameters(remove_duplicate=False)]
    return []
