"""Every private torch name pipecut uses, in one place, each behind a check where it can be.

torch renames and removes ``_``-prefixed names without notice: torch 2.14 dropped
``torch.fx._symbolic_trace._is_fx_tracing_flag`` (now a thread-local), and every capture
failed with an AttributeError deep inside :func:`pipecut.capture.bound.torch_state`. So no other
module of the package touches a private torch name (``tests/unit/core/test_torch_private.py``
walks their syntax trees to keep it so): they import what they need from here, where each name
has a public replacement, a feature check with a fallback that keeps pipecut's behaviour, or
(where nothing can stand in) one import that fails with the torch version and the range pipecut
supports instead of an AttributeError somewhere in the middle of a run.

``torch.ops.aten._xxx`` op overloads (``aten._scaled_dot_product_flash_attention_for_cpu``,
``aten._assert_tensor_metadata``) are not here: they are op names of the graph IR, matched like
any other node target, not Python API.

Each name, what pipecut uses it for, and what stands in where it is missing. All were checked on
torch 2.13.0 and 2.14.1 (present in both, but for the fx tracing flag).

Imported once, no fallback (an ImportError naming the torch version if any is missing):

- ``torch.utils._pytree`` (:data:`pytree`): flattening inputs, outputs and cut values and
  (de)serialising the output's tree spec. Its ``TreeSpec`` format is in every plan.
- ``torch._subclasses.fake_tensor``: :data:`FakeTensorMode` and :data:`FakeTensor` (profiling and
  shape propagation without memory), :data:`DataDependentOutputException` and
  :data:`DynamicOutputShapeException` (an op that fake tensors cannot run), and the name of its
  logger, :data:`FAKE_TENSOR_LOGGER` (silenced while a failed shape is an answer).
- ``torch.utils._python_dispatch.TorchDispatchMode`` (:data:`TorchDispatchMode`): counting flops
  and catching writes to inputs, op by op.
- ``torch.nn.utils.stateless._reparametrize_module`` (:data:`reparametrize_module`): running a
  graph on fake copies of its parameters (``torch.func.functional_call`` does the same only
  around one call of ``forward``, not around an fx interpreter's run).
- ``torch._ops.OpOverload`` (:data:`OpOverload`): telling an aten op overload, whose schema says
  whether a result aliases an input, from any other node target (a compiled stage copies the
  outputs that may be views).

Behind a check, with a fallback:

- ``torch.fx._symbolic_trace.is_fx_tracing`` (public function, private module;
  :func:`fx_tracing`): whether an fx trace is under way (2.13 keeps a module global
  ``_is_fx_tracing_flag``, 2.14 a thread-local). Missing: False.
- ``torch._C._len_torch_dispatch_stack``, ``torch._C._len_torch_function_stack``
  (:func:`dispatch_mode_depth`, :func:`function_mode_depth`), ``torch._C._are_functorch_transforms_active``
  (:func:`functorch_transforms_active`), ``torch._guards.TracingContext.try_get``
  (:func:`in_tracing_context`): the state a trace sets and puts back, compared before and after
  an interrupted capture. Missing: a constant (0, False), so the comparison stays equal.
- ``torch.fx.node._get_qualified_name`` (:func:`qualified_name`): stable names of node targets.
  Missing: the builtin's name, ``torch.Tensor.name`` or ``module.name``, as torch spells them.
- ``torch._foreach_norm`` (:func:`foreach_norm`): all gradient norms of a stage in one kernel
  launch. Missing: ``torch.linalg.vector_norm`` per tensor.
- ``torch.cuda._sleep`` (:func:`cuda_sleep`): a GPU busy-wait covering the host's dispatch
  while timing. Missing: None (no busy-wait).
- ``torch._dynamo.utils.counters`` (:func:`inductor_cache_hits`): inductor's FX graph cache hits
  when compiling stages. Missing: 0.
- ``torch.distributed._composable.replicate_with_fsdp.replicate`` (:func:`replicate_with_fsdp`):
  DDP over tensor-parallel stages. Missing: None (callers refuse with a message).
- ``torch.distributed._composable_state._get_module_state`` with FSDP2's ``FSDPState``
  (``_state_ctx.all_states``, ``_fsdp_param_groups``, ``FSDPParamGroup.post_backward``,
  ``_root_post_backward_final_callback``) (:func:`fsdp_post_backward`): FSDP2's gradient
  reduction after a split backward's last weight pass, which no autograd hook of FSDP2 sees.
  Missing: None (zero-bubble schedules with FSDP2 are refused with a message).
- ``torch.distributed.distributed_c10d._get_default_store`` (:func:`default_store`): the
  store where the first failing rank writes its error. Missing: None (errors still name the
  peer rank).
- ``torch._dynamo.lookup_backend`` (:func:`inductor_backend`): the inductor backend that
  pipecut's counting backend wraps. Missing: an ImportError telling to run stages eagerly.
- ``torch._functorch.config.donated_buffer`` (:func:`kept_saved_tensors`): off while a stage
  compiled apart compiles and while its split backward runs (AOTAutograd reads it at both), so
  that its backward may run with ``retain_graph=True`` (the input pass keeps the graph for the
  weight pass; a donated buffer refuses that).
  Missing: nothing to turn off (torch before donated buffers never donated them).

Not here: private *attributes of torch objects* (``Module._parameters``, ``Tensor._version``,
``Module._compiled_call_impl`` …), used in place where the object is at hand.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "FAKE_TENSOR_LOGGER",
    "SUPPORTED_TORCH",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "OpOverload",
    "TorchDispatchMode",
    "cuda_sleep",
    "default_store",
    "dispatch_mode_depth",
    "foreach_norm",
    "fsdp_post_backward",
    "function_mode_depth",
    "functorch_transforms_active",
    "fx_tracing",
    "in_tracing_context",
    "inductor_backend",
    "inductor_cache_hits",
    "kept_saved_tensors",
    "pytree",
    "qualified_name",
    "quiet_fake_tensors",
    "reparametrize_module",
    "replicate_with_fsdp",
]

SUPPORTED_TORCH = ">=2.13,<2.15"
"""The torch versions pipecut supports: its requirement in ``pyproject.toml`` (a test keeps the
two equal)."""


def _unsupported(what: str) -> ImportError:
    """The error for a private torch name this torch lacks and pipecut cannot do without."""
    return ImportError(
        f"pipecut needs {what}, which torch {torch.__version__} lacks; pipecut supports torch"
        f"{SUPPORTED_TORCH} (checked on 2.13.0 and 2.14.1): install a torch in that range"
    )


try:
    import torch.utils._pytree as pytree
    from torch._ops import OpOverload
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensor,
        FakeTensorMode,
    )
    from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError as e:  # pragma: no cover - only on a torch outside the supported range
    raise _unsupported(f"{e.name or 'a private module'} ({e})") from e

FAKE_TENSOR_LOGGER: str = FakeTensorMode.__module__
"""The logger fake tensors report failed ops on (their module's ``__name__``, which follows the
module if torch moves it)."""


@contextlib.contextmanager
def _silenced(logger_name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Keep a logger's records below ``level`` off the user's log for one call."""
    logger = logging.getLogger(logger_name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def quiet_fake_tensors() -> contextlib.AbstractContextManager[None]:
    """Fake tensors log a traceback for every op that fails; where a failure is an answer (this
    shape does not fit), keep it off the user's log."""
    return _silenced(FAKE_TENSOR_LOGGER, logging.CRITICAL)


def fx_tracing() -> bool:
    """Whether an fx trace (symbolic_trace or torch.export) is under way in this thread. torch
    logs a warning at the first call of ``is_fx_tracing`` (use ``is_fx_symbolic_tracing`` or
    ``is_compiling`` instead: neither tells a flag left set by an interrupted export), kept
    off the user's log here."""
    try:
        from torch.fx._symbolic_trace import is_fx_tracing
    except ImportError:
        return False
    with _silenced(is_fx_tracing.__module__):
        return bool(is_fx_tracing())


def dispatch_mode_depth() -> int:
    """How many ``TorchDispatchMode``s are active (0 where this torch cannot tell)."""
    depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return int(depth()) if depth is not None else 0


def function_mode_depth() -> int:
    """How many ``TorchFunctionMode``s are active (0 where this torch cannot tell)."""
    depth = getattr(torch._C, "_len_torch_function_stack", None)
    return int(depth()) if depth is not None else 0


def functorch_transforms_active() -> bool:
    """Whether a functorch transform (vmap, grad, functionalize) is active (False where this
    torch cannot tell)."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def in_tracing_context() -> bool:
    """Whether a Dynamo/export ``TracingContext`` is set (False where this torch cannot tell)."""
    try:
        from torch._guards import TracingContext
    except ImportError:
        return False
    try_get = getattr(TracingContext, "try_get", None)
    return try_get is not None and try_get() is not None


def qualified_name(target: Callable[..., Any]) -> str:
    """torch's name for a ``call_function`` target (``torch.ops.aten.mm.default``,
    ``_operator.add``); raises where the target has no name (a lambda, say)."""
    try:
        from torch.fx.node import _get_qualified_name
    except ImportError:
        name = target.__name__
        if getattr(builtins, name, None) is target:
            return name
        if getattr(torch.Tensor, name, None) is target:
            return f"torch.Tensor.{name}"
        return f"{target.__module__.replace('torch._ops', 'torch.ops')}.{name}"
    return _get_qualified_name(target)


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """The ``ord``-norm of each tensor: one fused launch where torch has ``_foreach_norm``, one
    ``vector_norm`` per tensor otherwise (the same values)."""
    fused = getattr(torch, "_foreach_norm", None)
    if fused is None:
        return [torch.linalg.vector_norm(t, ord) for t in tensors]
    return list(fused(list(tensors), ord))


def cuda_sleep() -> Callable[[int], None] | None:
    """torch's GPU busy-wait kernel (its argument: clock cycles), None where torch has none."""
    return getattr(torch.cuda, "_sleep", None)


def inductor_backend() -> Callable[..., Any]:
    """The ``torch.compile`` backend ``"inductor"`` as a callable, for a backend that wraps it."""
    try:
        from torch._dynamo import lookup_backend
    except ImportError as e:
        raise ImportError(
            f"{_unsupported('torch._dynamo.lookup_backend to compile stages')}; or run the "
            f"stages eagerly: RuntimeOptions(compile_stages=False)"
        ) from e
    return lookup_backend("inductor")


def inductor_cache_hits() -> int:
    """Inductor's FX graph cache hits so far in this process (0 where torch does not count)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"]["fxgraph_cache_hit"])


def kept_saved_tensors() -> contextlib.AbstractContextManager[Any]:
    """A context in which AOTAutograd compiles backwards that keep their saved tensors
    (``donated_buffer`` off), so they can run with ``retain_graph=True``."""
    try:
        from torch._functorch import config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "donated_buffer"):
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


def replicate_with_fsdp() -> Callable[..., Any] | None:
    """torch's DDP built on FSDP2 (``replicate``), None where this torch has none."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:
        return None
    return replicate


def fsdp_post_backward() -> Callable[[torch.nn.Module], None] | None:
    """FSDP2's end-of-backward work run by hand on a module ``fully_shard`` or FSDP2's
    ``replicate`` wrapped: every parameter group's ``post_backward`` (reduce-scatter, or
    all-reduce, of the gradients accumulated unsharded, then reshard), then the root's final
    callback (wait for those reductions). A split backward's weight pass writes the gradients
    after the autograd call whose hooks would have done this, so it is called after the step's
    last weight pass, as ``torch.distributed.pipelining`` does (``perform_reduce_grad``). None
    where this torch lacks the pieces (callers refuse with a message)."""
    try:
        from torch.distributed._composable_state import _get_module_state
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return None
    if not callable(getattr(FSDPState, "_root_post_backward_final_callback", None)):
        return None

    def run(module: torch.nn.Module) -> None:
        state = _get_module_state(module)
        if not isinstance(state, FSDPState):
            raise TypeError(f"{type(module).__name__} is not wrapped by FSDP2 (its state: {type(state).__name__})")
        for each in state._state_ctx.all_states:
            for group in getattr(each, "_fsdp_param_groups", None) or [g for g in [each._fsdp_param_group] if g]:
                group.post_backward()
        state._root_post_backward_final_callback()

    return run


def default_store() -> dist.Store | None:
    """The default process group's store, None where there is none or this torch does not give
    it."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None
