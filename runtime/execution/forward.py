"""Forward-only steps (evaluation), the model's outputs, and train/eval stage programs.

Under ``torch.no_grad()`` a step runs only the forward actions of the schedule: nothing is
kept for backward, no ``.grad`` is written and no gradients are reduced. The last stage can
keep each microbatch's output (in the model's own output structure) and concatenate them
along the batch dimension, which is how the inputs were split.

Capture specialises the training flag, so a pipeline holds one set of stage programs per mode
(the same objects when both modes capture the same graph); a :class:`ModeSwitch` supplied by
``pipecut.compile`` builds them and keeps the user's model in the matching mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pipecut.core.torch_private import pytree
from pipecut.errors import PipelineRuntimeError
from pipecut.runtime.comm.wire import WireSpec

if TYPE_CHECKING:  # stage.py imports this module
    from pipecut.runtime.execution.stage import StageWorker

__all__: list[str] = []


class ModeSwitch(Protocol):
    """What a :class:`~pipecut.runtime.pipeline.Pipeline` needs to change train/eval mode."""

    captured_training: bool
    """The mode the plan's graph was captured in (the model's mode at compile)."""

    def workers(self, training: bool) -> Mapping[int, StageWorker]:
        """This rank's stage workers for the mode; raises if the mode cannot be run."""
        ...

    def set(self, training: bool) -> None:
        """Put the user's model and every stage program in the mode."""
        ...

    def check(self, training: bool) -> None:
        """Raise if the model's modules are not in the modes the mode's graph was captured in."""
        ...

    def without_separate_mode(self, error: Exception) -> ModeSwitch:
        """These modes, where the mode whose stage programs are not the captured ones raises
        ``error`` when asked for (a new value; this one is unchanged)."""
        ...

    def wire(self, training: bool) -> Any:
        """The wire resolver of the mode's own graph where its stage programs are not the
        captured ones (its cut values have their own node names); None: the pipeline's."""
        ...


@contextlib.contextmanager
def collecting(worker: StageWorker, *, keep_outputs: bool, compute_loss: bool) -> Iterator[list[Any]]:
    """While active, the last stage ``worker`` appends each microbatch's output (detached, in
    the model's structure) to the yielded list and computes the loss only if asked."""
    outputs: list[Any] = []
    loss_fn = worker.loss_fn

    def observe(out: Any, target: Any) -> torch.Tensor:
        if keep_outputs:
            outputs.append(pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out))
        if compute_loss:
            assert loss_fn is not None
            return loss_fn(out, target)
        return torch.zeros((), device=worker.device)

    worker.loss_fn = observe
    try:
        yield outputs
    finally:
        worker.loss_fn = loss_fn


def concat_microbatches(outputs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """One output for the whole batch: tensor leaves whose first dimension is each
    microbatch's size (``sizes``) concatenated along it; other leaves must be equal in every
    microbatch (else an error)."""
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    for i, (_, s) in enumerate(flat):
        if s != spec:
            raise PipelineRuntimeError(
                f"microbatch {i}'s output is structured as {s}, microbatch 0's as {spec}; "
                f"outputs can only be concatenated when every microbatch has the same structure"
            )
    merged = []
    for j, leaf in enumerate(flat[0][0]):
        column = [leaves[j] for leaves, _ in flat]
        if all(isinstance(c, torch.Tensor) and c.dim() > 0 and c.shape[0] == n for c, n in zip(column, sizes)):
            merged.append(torch.cat(column))
        elif all(_same(leaf, other) for other in column[1:]):
            merged.append(leaf)
        else:
            what = f"a tensor of shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else repr(leaf)
            raise PipelineRuntimeError(
                f"output leaf {j} is {what}: it has no batch dimension of size {sizes[0]} "
                f"first and differs between microbatches, so it has no whole-batch value; "
                f"return per-sample values from the model, or compute this from the outputs"
            )
    return pytree.tree_unflatten(merged, spec)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return type(a) is type(b) and bool(a == b)


def check_grad_flags(tensors: Sequence[torch.Tensor], spec: WireSpec, stage: int) -> None:
    """The tensors a stage sends must require grad exactly where the plan says, or gradients
    would silently not flow back (or be waited for in vain). Changing a parameter's
    ``requires_grad`` after ``compile`` can change that."""
    for t, leaf in zip(tensors, spec.tensors):
        if t.requires_grad != leaf.requires_grad:
            name = spec.values[leaf.value].name
            raise PipelineRuntimeError(
                f"stage {stage}: value {name!r} (leaf {leaf.leaf}) "
                f"{'requires' if t.requires_grad else 'does not require'} grad, but the plan was "
                f"made when it {'did' if leaf.requires_grad else 'did not'}: a parameter's "
                f"requires_grad changed after pipecut.compile. Set requires_grad before compile "
                f"and compile again (re-plan) after changing it"
            )
