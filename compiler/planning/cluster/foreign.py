"""What another runtime holds that pipecut's own does not: for pricing a published run as it ran.

pipecut's runtime makes the logits whole before the user's loss and frees a stage's outputs
once they are sent or their loss has run backward. A published run checked against pipecut's
prediction (``benchmarks/validation.py``) may have run on a runtime that holds more; the run
names what (:class:`RuntimeTerm`, ``RunShape.runtime_terms``) and each term below is sized
from the workload's shapes, as torch's source for that runtime allocates it. Nothing here is
fitted to a published figure; each term is 0 where its runtime behaviour does not arise.

The workload is taken to end in the loss, as a training cost table does: its last unit that
computes (the graph's output node, a unit without work, may follow it). The loss reads the
model's output, the logits, which is what crosses the cut before it.
"""

from __future__ import annotations

import dataclasses
import enum

from pipecut.passes.costs.workload import Workload
from pipecut.planning.cluster.stage import StageWork

__all__ = [
    "LOGIT_BYTES",
    "LOSS_PARALLEL_BACKWARD_BYTES",
    "RuntimeTerm",
    "kept_output_bytes",
    "loss_workspace_bytes",
    "receive_buffer_bytes",
    "with_runtime",
]

LOGIT_BYTES = 2
"""Bytes of one logit as the model hands it to the loss: bf16, the compute dtype of the runs
priced here (torchtitan's mixed precision ``param_dtype``). Turns the logits' bytes into their
element count."""

LOSS_PARALLEL_BACKWARD_BYTES = 16
"""Bytes per local logit at the backward peak of torch's loss-parallel cross entropy
(``torch/distributed/tensor/parallel/loss.py``): the saved fp32 log-softmax result ``x`` (4),
``grad_input = torch.zeros_like(x)`` (4), ``torch.exp(x)`` (4) and their sum (4), alive
together in ``_nll_loss_and_log_softmax_backward``'s ``(grad_input + torch.exp(x)) *
grad_output`` (and again the sum, ``x``, ``grad_input`` and the product after ``exp(x)`` is
freed). Its forward (``_log_softmax``) peaks lower: 14."""


class RuntimeTerm(enum.Enum):
    """A behaviour of a published run's runtime that costs memory pipecut's runtime does not spend."""

    LOSS_PARALLEL = "loss-parallel"
    """torchtitan runs its cross entropy inside ``loss_parallel()`` on logits sharded by
    vocabulary over the tensor group (T > 1): the loss's backward needs
    :data:`LOSS_PARALLEL_BACKWARD_BYTES` per local logit at once (:func:`loss_workspace_bytes`)."""
    PIPELINE_KEEPS_OUTPUTS = "pipeline-keeps-outputs"
    """torch.distributed.pipelining's last stage keeps every microbatch's output until the next
    step (K > 1): :func:`kept_output_bytes`."""
    PIPELINE_BUFFERS = "pipeline-buffers"
    """torch.distributed.pipelining gives every microbatch its own receive buffers, allocated
    once and kept from step to step: the stage's input (every stage but the first) and its
    output's gradient (every stage but the last); each backward leaves the input's gradient on
    its buffer until the next step clears it (K > 1): :func:`receive_buffer_bytes`."""


def _loss_unit(work: Workload, start: int, end: int) -> int | None:
    """The loss's unit where the stage of units ``[start, end)`` holds it, else None."""
    if not work.cut_forward_bytes:
        return None
    loss = max((u for u in range(work.units) if work.forward_ms[u] > 0), default=None)
    return loss if loss is not None and start <= loss < end else None


def loss_workspace_bytes(work: Workload, start: int, end: int, replicas: int, tensor_parallel: int) -> float:
    """The loss's backward workspace on the stage of units ``[start, end)``, one GPU at one of
    ``replicas`` replicas' share, beyond what the loss keeps (its activations, already counted):
    :data:`LOSS_PARALLEL_BACKWARD_BYTES` per local logit less those. It is a transient of the
    loss's backward, which ends before the first block's recompute starts, so it takes the
    place of the block's recompute transient where larger, never adds to it. 0 where the stage
    does not hold the loss or without tensor parallelism (no loss parallelism: the logits are
    whole and the loss is the cost table's own).

    >>> w = Workload(forward_ms=(1.0, 1.0), backward_ms=(1.0, 1.0), param_bytes=(1, 0),
    ...              activation_bytes=(0, 8 * 100), cut_forward_bytes=(0, 2 * 100, 0))
    >>> loss_workspace_bytes(w, 0, 2, 1, 8), loss_workspace_bytes(w, 0, 2, 1, 1)
    (800.0, 0.0)
    """
    last = _loss_unit(work, start, end)
    if tensor_parallel <= 1 or last is None:
        return 0.0
    logits = work.cut_forward_bytes[last] / replicas / LOGIT_BYTES
    kept = (work.activation_bytes[last] if work.activation_bytes else 0) / replicas
    return max(0.0, LOSS_PARALLEL_BACKWARD_BYTES * logits - kept)


def kept_output_bytes(work: Workload, start: int, end: int, replicas: int, ranks: int) -> float:
    """Per microbatch, the bytes the stage of units ``[start, end)`` keeps from its forward until
    the step ends: on the stage that holds the loss, the model's output the loss reads (the
    logits), which ``torch/distributed/pipelining/stage.py``'s
    ``_PipelineStageBase.forward_one_chunk`` appends to ``output_chunks`` on the last stage and
    only ``clear_runtime_states`` drops, at the next ``step``: the whole local batch's logits by
    the last microbatch. 0 on the other stages and with one pipeline rank (``ranks`` = K = 1:
    no pipelining, and torchtitan then drops the logits before backward).

    >>> w = Workload(forward_ms=(1.0, 1.0, 0.0), backward_ms=(1.0, 1.0, 0.0), param_bytes=(1, 0, 0),
    ...              cut_forward_bytes=(0, 200, 4, 0))
    >>> kept_output_bytes(w, 1, 3, 2, 4), kept_output_bytes(w, 0, 1, 2, 4), kept_output_bytes(w, 1, 3, 2, 1)
    (100.0, 0.0, 0.0)
    """
    last = _loss_unit(work, start, end)
    if ranks <= 1 or last is None:
        return 0.0
    return work.cut_forward_bytes[last] / replicas


def receive_buffer_bytes(work: Workload, start: int, end: int, replicas: int, ranks: int) -> tuple[float, float]:
    """Per microbatch, the stage of units ``[start, end)``'s receive buffers in torch's
    pipelining: (its input, its output's gradient). ``torch/distributed/pipelining/stage.py``
    allocates them per microbatch index when the schedule first runs
    (``_prepare_forward_infra``'s ``args_recv_info[chunk]``, ``_prepare_backward_infra``'s
    ``grad_recv_info[mb_index]``, each through ``_make_tensor_from_meta``) and keeps them for
    every later step; ``clear_runtime_states`` only drops the input buffers' ``.grad`` at the
    start of the next step. The first stage reads its input from the data (no buffer); the
    stage that holds the loss starts its own backward (no gradient buffer). (0, 0) with one
    pipeline rank.

    >>> w = Workload(forward_ms=(1.0, 1.0, 1.0), backward_ms=(1.0, 1.0, 1.0), param_bytes=(1, 1, 0),
    ...              cut_forward_bytes=(8, 40, 30, 0), cut_backward_bytes=(0, 40, 30, 0))
    >>> receive_buffer_bytes(w, 0, 1, 2, 2), receive_buffer_bytes(w, 1, 3, 2, 2), receive_buffer_bytes(w, 1, 3, 2, 1)
    ((0.0, 20.0), (20.0, 0.0), (0.0, 0.0))
    """
    if ranks <= 1 or not work.cut_forward_bytes:
        return 0.0, 0.0
    grads = work.cut_backward_bytes or work.cut_forward_bytes
    received = work.cut_forward_bytes[start] / replicas if start > 0 else 0.0
    sent = grads[end] / replicas if _loss_unit(work, start, end) is None and end < work.units else 0.0
    return float(received), float(sent)


def with_runtime(stage: StageWork, work: Workload, start: int, end: int, *, replicas: int, ranks: int,
                 tensor_parallel: int, microbatches: int, terms: tuple[RuntimeTerm, ...]) -> StageWork:
    """``stage`` (units ``[start, end)``) as the runtime of ``terms`` holds it: the loss's
    workspace in place of the recompute transient where larger, the outputs kept to step end,
    the receive buffers of all ``microbatches`` standing (the input a microbatch keeps, which
    its first op saves, is its buffer: counted there, not again) and each backward's input
    gradient left on its buffer."""
    if not terms:
        return stage
    out = stage
    if RuntimeTerm.LOSS_PARALLEL in terms:
        loss = loss_workspace_bytes(work, start, end, replicas, tensor_parallel)
        if loss > out.transient_bytes:
            out = dataclasses.replace(out, transient_bytes=loss)
    if RuntimeTerm.PIPELINE_KEEPS_OUTPUTS in terms:
        held = kept_output_bytes(work, start, end, replicas, ranks)
        if held:
            out = dataclasses.replace(out, held_bytes=held)
    if RuntimeTerm.PIPELINE_BUFFERS in terms:
        received, sent = receive_buffer_bytes(work, start, end, replicas, ranks)
        if received or sent:
            out = dataclasses.replace(out, standing_bytes=microbatches * (received + sent), left_bytes=received,
                                      kept_bytes=max(0.0, out.kept_bytes - received))
    return out
