"""Execute one rank's schedule: one method per action kind, state per microbatch.

A forward receives the cut values from the previous stage, runs the stage module and sends its
cut values on (the last stage computes the loss instead). A backward receives the gradients of
what this stage sent, runs autograd from there, and sends the gradients of what it received.
Received floating leaves that require grad in the plan become autograd leaves, so their
``.grad`` after backward is exactly what the previous stage needs. The worker does not decide
when tensors travel: it turns the executor's transfers into ``P2POp``s (:meth:`p2p_op`), with
receive buffers filled in its inbox and the tensors it sends left in its outbox until then.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from pipecut.core.kinds import Recompute
from pipecut.core.program import StageProgram
from pipecut.core.segment import Segment, torch_checkpoint
from pipecut.core.torch_private import kept_saved_tensors, pytree
from pipecut.errors import PipelineRuntimeError
from pipecut.ir import NodeCost, Plan
from pipecut.runtime.comm.p2p import Direction, Op, Transfer
from pipecut.runtime.comm.wire import Peer, TensorLeaf, WireSpec, pack, unpack
from pipecut.runtime.execution.backward_split import split_backward
from pipecut.runtime.execution.compiled import (
    MIN_RUN,
    CompileStats,
    compile_apart,
    compile_program,
    uncompile_stage,
)
from pipecut.runtime.execution.forward import check_grad_flags
from pipecut.runtime.execution.held_recompute import held_checkpoint
from pipecut.runtime.execution.recompute_state import StateReplay
from pipecut.runtime.memory.activations import ActivationMeter, storage_of
from pipecut.schedules.format import ActionKind

if TYPE_CHECKING:
    from pipecut.runtime.execution.tensor_parallel import TokenWire

__all__ = ["GradSync", "LossFn", "StageWorker", "tree_to"]

LossFn = Callable[[Any, Any], torch.Tensor]

log = logging.getLogger(__name__)


class GradSync(Protocol):
    """A data-parallel wrapper's part in each backward pass of its stage: ``kind`` is the pass
    (``BACKWARD`` whole, or a split backward's ``INPUT`` and ``WEIGHT`` parts), ``mb`` its
    microbatch. See :mod:`pipecut.runtime.grads.data_parallel`."""

    def before(self, kind: ActionKind, mb: int) -> None: ...

    def after(self, kind: ActionKind, mb: int) -> None: ...


class _NoSync:
    """A stage without replicas: nothing to reduce."""

    def before(self, kind: ActionKind, mb: int) -> None:
        pass

    def after(self, kind: ActionKind, mb: int) -> None:
        pass


@dataclass
class _Microbatch:
    received: list[torch.Tensor] = field(default_factory=list)
    """Tensor leaves received (autograd leaves where they require grad)."""
    sent: list[torch.Tensor] = field(default_factory=list)
    """Tensor leaves sent that carry gradients back, to backpropagate from."""
    loss: torch.Tensor | None = None
    weight_pass: Callable[[], None] | None = None
    """Zero-bubble schedules: the deferred weight-gradient pass of this microbatch."""


class StageWorker:
    def __init__(
        self,
        program: StageProgram,
        plan: Plan,
        *,
        rank: int,
        ranks: Sequence[int],
        group: dist.ProcessGroup | None,
        device: torch.device,
        loss_fn: LossFn | None,
        unflatten_output: Callable[[Any], Any],
        timeout: datetime.timedelta,
        apart: bool = False,
    ) -> None:
        self.program = program
        self.plan = plan
        self.stage = program.index
        self.rank = rank
        self.device = device
        self.loss_fn = loss_fn
        self.unflatten_output = unflatten_output
        if program.is_last and loss_fn is None:
            raise PipelineRuntimeError("the last stage needs a loss_fn to start the backward pass")
        last = plan.num_stages - 1
        s = self.stage  # the neighbours' ranks: the plan's placement (may be this rank itself)
        self.prev = Peer(group, ranks[plan.rank_of(s - 1)], s, timeout, rank) if s > 0 else None
        self.next = Peer(group, ranks[plan.rank_of(s + 1)], s + 1, timeout, rank) if s < last else None
        stage = plan.stages[self.stage]
        self.recompute = stage.recompute is Recompute.FULL
        self.recomputes = stage.recompute is not Recompute.NONE
        """The whole stage or some of its blocks run their forward again in backward."""
        self.checkpoint: Callable[..., Any] = torch_checkpoint
        """How a recomputing run keeps its tensors: torch's checkpoint, or under a split
        backward one that recomputes once for both passes (:mod:`pipecut.runtime.execution.held_recompute`)."""
        if plan.schedule.splits_backward:
            self.checkpoint = held_checkpoint
            for segment in (m for m in program.module.modules() if isinstance(m, Segment)):
                segment.recompute = held_checkpoint
        self.in_spec = WireSpec(tuple(plan.node(n) for n in stage.inputs))
        self.out_spec = WireSpec(tuple(plan.node(n) for n in stage.outputs))
        self.specs: list[tuple[WireSpec, WireSpec]] = []
        """Per microbatch of the step: (received, sent) specs; the plan's when empty."""
        self.weights: list[Fraction] = []
        """Per microbatch of the step: the factor of its loss (size / batch); 1/M when empty."""
        self._built: dict[int, tuple[Mapping[str, NodeCost], tuple[WireSpec, WireSpec]]] = {}
        """Specs built per resolved mapping (held, so its id stays its own), oldest first."""
        self.meter = ActivationMeter(program.module.parameters())
        self.replay = StateReplay(program.module)
        """A recomputing stage's buffers as each forward saw them, for its recompute."""
        self._segment_hooks = self._hook_segments()
        self.state_storage = _storages(program.module)
        self.state: dict[int, _Microbatch] = {}
        self.inbox: dict[tuple[Direction, int], dict[int, torch.Tensor]] = {}
        """Receive buffers by (direction, microbatch), then leaf; filled once their batch is waited."""
        self.outbox: dict[tuple[Direction, int, int], torch.Tensor] = {}
        """Tensors computed but not yet handed to a send."""
        self.loss_divisor: float | None = None
        """loss_reduction="sum": each microbatch's loss is divided by it (set per step; see
        ``pipecut.runtime.grads.collective``); None: a mean, weighted by microbatch size."""
        self.scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None
        """A GradScaler's ``scale``: backward starts from the scaled loss (set per step)."""
        self.call: Callable[..., Any] = program.module
        """What a forward calls: the stage module, or its data-parallel wrapper."""
        self.apart = apart or plan.schedule.splits_backward
        """:meth:`compile` leaves the ops that read parameters eager: under a split backward
        (the weight pass needs their autograd nodes), or asked (``apart``: a stage split
        over a tensor group, whose DTensor parameter ops Dynamo fails on: see
        :mod:`pipecut.runtime.execution.compiled`)."""
        self.compiled: CompileStats | None = None
        """With ``compile_stages``: what compiling the stage module cost (see
        :mod:`pipecut.runtime.execution.compiled`); None when it runs eagerly."""
        self._eager_graph: torch.fx.Graph | None = None
        """The stage graph before compiling swapped it (None: not compiled)."""
        self.grad_sync: GradSync = _NoSync()
        """Data parallelism: the wrapper, told of each backward pass (it reduces in the last)."""
        self.reduce_grads = True
        """Whether this step's gradients are reduced across ranks (False under ``no_sync``):
        the data-parallel wrappers read it before the last backward."""
        self.tokens: TokenWire | None = None
        """Sequence parallelism: the cut values that travel as token shards (set by the build;
        None: every cut value travels whole, as its spec says)."""

    def _hook_segments(self) -> list[Any]:
        """The meter counts the inputs each recomputing segment keeps (eager stages)."""
        return [
            segment.register_forward_pre_hook(lambda _, args: self.meter.keep(
                a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)))
            for segment in (m for m in self.program.module.modules() if isinstance(m, Segment))
        ]

    def compile(self) -> None:
        """Run the stage module through ``torch.compile`` from its next call on (see
        :mod:`pipecut.runtime.execution.compiled`): whole, or apart from the ops that read
        parameters (:attr:`apart`). Compiled whole, the segments' inputs are among the compiled
        graph's saved tensors, which the meter counts already: their hooks go (a hook inside
        the compiled region would also break its graph); compiled apart, the segments run
        eagerly and keep them."""
        if self.apart:
            assert isinstance(self.program.module, torch.fx.GraphModule)
            self.compiled, self._eager_graph = compile_apart(self.program.module, self.stage)
            if self.compiled.runs == 0:
                log.warning("stage %d (rank %d) compiles nothing: compiled apart from the ops that read "
                            "parameters, it has no run of %d or more other ops; it runs eagerly",
                            self.stage, self.rank, MIN_RUN)
            return
        for hook in self._segment_hooks:
            hook.remove()
        self._segment_hooks = []
        assert isinstance(self.program.module, torch.fx.GraphModule)
        self.compiled, self._eager_graph = compile_program(self.program.module, self.stage)

    def uncompile(self) -> None:
        """Back to eager calls of the stage module (``compile_stages="auto"`` chose eager)."""
        if self.compiled is not None:
            uncompile_stage(self.program.module, self._eager_graph)
            self.compiled, self._eager_graph = None, None
            for hook in self._segment_hooks:
                hook.remove()
            self._segment_hooks = self._hook_segments()

    def prepare(self, wire: Sequence[Mapping[str, NodeCost] | None], weights: Sequence[Fraction]) -> None:
        """Before a step: each microbatch's cut values (None: as planned) and loss factor."""
        stage = self.plan.stages[self.stage]
        self.specs = []
        for nodes in wire:
            if nodes is None:
                self.specs.append((self.in_spec, self.out_spec))
                continue
            if id(nodes) not in self._built:
                if len(self._built) >= 1024:
                    self._built.pop(next(iter(self._built)))
                self._built[id(nodes)] = (nodes, (WireSpec(tuple(nodes[n] for n in stage.inputs)),
                                                  WireSpec(tuple(nodes[n] for n in stage.outputs))))
            self.specs.append(self._built[id(nodes)][1])
        self.weights = list(weights)

    def _spec(self, mb: int) -> tuple[WireSpec, WireSpec]:
        return self.specs[mb] if mb < len(self.specs) else (self.in_spec, self.out_spec)

    def begin(self) -> None:
        """Forget the previous step."""
        self.state, self.inbox, self.outbox = {}, {}, {}
        self.meter.reset()
        self.replay.reset()

    def p2p_op(self, t: Transfer) -> dist.P2POp:
        """The ``P2POp`` of one transfer: a fresh receive buffer, or a tensor from the outbox."""
        peer = self.prev if t.cut == self.stage else self.next
        if peer is None:
            raise PipelineRuntimeError(f"stage {self.stage} has no neighbour across cut {t.cut} for {t}")
        if t.op is Op.RECV:
            in_spec, out_spec = self._spec(t.microbatch)  # this microbatch's shapes and dtypes
            spec = in_spec.tensors if t.direction is Direction.FORWARD else out_spec.grads
            leaf = spec[t.leaf]
            values = in_spec if t.direction is Direction.FORWARD else out_spec
            buf = torch.empty(self.wire_shape(values, leaf), dtype=leaf.dtype, device=self.device)
            self.inbox.setdefault((t.direction, t.microbatch), {})[t.leaf] = buf
            return peer.recv_op(buf, t)
        tensor = self.outbox.pop((t.direction, t.microbatch, t.leaf), None)
        if tensor is None:
            raise PipelineRuntimeError(
                f"stage {self.stage}: the executor sends {t} but the stage computed no such tensor; "
                f"the plan's wiring and the stage program disagree (re-plan)"
            )
        return peer.send_op(tensor, t)

    def wire_shape(self, spec: WireSpec, leaf: TensorLeaf) -> tuple[int, ...]:
        """The shape ``leaf`` of ``spec`` has on the wire (a token shard's is a T-th of it)."""
        return self.tokens.shape(spec, leaf) if self.tokens is not None else leaf.shape

    def arrived(self, tensors: Sequence[torch.Tensor], spec: WireSpec) -> list[Any]:
        """The values a forward reads from the tensor leaves received for ``spec``."""
        views = self.tokens.arrive(tensors, spec) if self.tokens is not None else tensors
        return unpack(views, spec, self.stage)

    def check_all_sent(self) -> None:
        if self.outbox:
            left = sorted(f"{d.value}{mb}.{leaf}" for d, mb, leaf in self.outbox)
            raise PipelineRuntimeError(f"stage {self.stage}: tensors computed but never sent: {left}")

    def loss(self) -> torch.Tensor | None:
        """Sum of this step's weighted microbatch losses on the last stage, else None."""
        if not self.program.is_last:
            return None
        return torch.stack([mb.loss for mb in self.state.values() if mb.loss is not None]).sum()

    def _received(self, mb: int, direction: Direction, count: int) -> list[torch.Tensor]:
        """The tensors received for ``mb`` (the executor has waited for them)."""
        got = self.inbox.pop((direction, mb), {})
        if len(got) != count:
            raise PipelineRuntimeError(
                f"stage {self.stage}: microbatch {mb} needs {count} {direction.name.lower()} "
                f"tensors, {len(got)} were received; the executor's transfers and the plan disagree"
            )
        return [got[i] for i in range(count)]

    def forward(self, mb: int, model_inputs: dict[str, Any], target: Any) -> None:
        state = self.state.setdefault(mb, _Microbatch())
        in_spec, out_spec = self._spec(mb)
        received: list[Any] = []
        if self.prev is not None:
            tensors = self._received(mb, Direction.FORWARD, len(in_spec.tensors))
            for t, leaf in zip(tensors, in_spec.tensors):
                t.requires_grad_(leaf.requires_grad)
            received = self.arrived(tensors, in_spec)
            state.received = tensors
        args = received + [model_inputs[name] for name in self.program.model_inputs]
        kept = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)] if self.recompute else []
        replay = self.replay.forward(mb) if self.recomputes and torch.is_grad_enabled() else contextlib.nullcontext()
        with self.meter.forward(mb, kept), replay:
            # recompute: keep only the inputs; the forward runs again inside backward
            out = self.checkpoint(self.call, *args) if self.recompute else self.call(*args)
            if self.program.is_last:
                loss = self._loss(out, target)
                if self.loss_divisor is not None:  # a sum over the batch, divided by a normaliser
                    state.loss = loss / self.loss_divisor
                else:  # loss * 1 / M is bitwise loss / M; uneven microbatches weigh size / batch
                    weight = self.weights[mb] if mb < len(self.weights) else Fraction(1, self.plan.microbatches)
                    state.loss = loss * weight.numerator / weight.denominator
                return
        tensors = pack(out, out_spec, self.stage)
        if torch.is_grad_enabled():
            check_grad_flags(tensors, out_spec, self.stage)
        if self.tokens is not None:
            tensors = self.tokens.depart(tensors, out_spec)
        tensors = _own(tensors, self.state_storage)
        state.sent = [t for t, leaf in zip(tensors, out_spec.tensors) if leaf.requires_grad]
        self._send(tensors, mb, Direction.FORWARD)

    def _loss(self, out: Any, target: Any) -> torch.Tensor:
        loss = self.loss_fn(self.unflatten_output(out), target)  # type: ignore[misc]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise PipelineRuntimeError(
                f"stage {self.stage}: loss_fn must return a scalar tensor, got "
                f"{getattr(loss, 'shape', type(loss).__name__)}; reduce it (e.g. .mean())"
            )
        return loss

    def backward(self, mb: int, weights_later: bool = False) -> None:
        """The microbatch's backward; with ``weights_later`` only its input-gradient part, the
        weight gradients being left to :meth:`backward_weight` (zero-bubble schedules)."""
        state = self.state[mb]
        kind = ActionKind.INPUT if weights_later else ActionKind.BACKWARD
        self.grad_sync.before(kind, mb)
        if self.program.is_last:
            assert state.loss is not None
            root = self.scale_loss(state.loss) if self.scale_loss is not None else state.loss
            outputs, grads = [root], [torch.ones_like(root)]
        else:
            received = self._received(mb, Direction.BACKWARD, len(self._spec(mb)[1].grads))
            pairs = [(t, g) for t, g in zip(state.sent, received) if t.requires_grad]
            outputs, grads = [t for t, _ in pairs], [g for _, g in pairs]
        inputs = [t for t in state.received if t.requires_grad]
        if weights_later:
            params = list(self.program.module.parameters())
            with self.replay.replaying(mb, keep=True), self._retaining():  # the weight pass may recompute too
                input_grads, state.weight_pass = split_backward(outputs, grads, inputs, params)
        else:
            if outputs:
                with self.replay.replaying(mb):  # a recompute must not write module state again
                    torch.autograd.backward(outputs, grads)
            input_grads = [t.grad for t in inputs]
            self.meter.release(mb)
        self.grad_sync.after(kind, mb)
        if state.loss is not None:
            state.loss = state.loss.detach()
        if self.prev is not None:
            self._send([g if g is not None else torch.zeros_like(t)
                        for g, t in zip(input_grads, inputs)], mb, Direction.BACKWARD)
        state.received = []
        state.sent = []

    def _retaining(self) -> contextlib.AbstractContextManager[Any]:
        """Around a split backward's passes: the input pass keeps the graph for the weight pass,
        which a compiled run's backward allows only with donated buffers off (also when it runs:
        AOTAutograd checks the flag then)."""
        return kept_saved_tensors() if self.compiled is not None else contextlib.nullcontext()  # compiled apart

    def backward_weight(self, mb: int) -> None:
        """The weight-gradient part of a backward whose input part has run."""
        state = self.state[mb]
        if state.weight_pass is None:
            raise PipelineRuntimeError(f"stage {self.stage}: {mb}W runs before {mb}I")
        self.grad_sync.before(ActionKind.WEIGHT, mb)
        with self.replay.replaying(mb), self._retaining():
            state.weight_pass()
        state.weight_pass = None
        self.grad_sync.after(ActionKind.WEIGHT, mb)
        self.meter.release(mb)

    def _send(self, tensors: list[torch.Tensor], mb: int, direction: Direction) -> None:
        """Leave the tensors for the executor's next batch (gloo needs contiguous buffers)."""
        for i, t in enumerate(tensors):
            self.outbox[(direction, mb, i)] = t.detach().contiguous()


def tree_to(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)


def _storages(module: torch.nn.Module) -> set[int]:
    return {storage_of(t).data_ptr() for t in [*module.parameters(), *module.buffers()]}


def _own(tensors: list[torch.Tensor], state: set[int]) -> list[torch.Tensor]:
    """Clone sent tensors that are module state (a buffer updated in place, ``self.calls += 1``
    under torch.export): the send is asynchronous and the next microbatch writes the buffer
    again, so the message must not share its memory."""
    return [t.clone() if storage_of(t).data_ptr() in state else t for t in tensors]
