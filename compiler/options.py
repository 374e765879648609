"""What a user asks of ``plan`` and ``compile``, as data: one frozen options object per concern.

``pipecut.plan(model, inputs, devices, partition=PartitionOptions(recompute="full"))`` and
``pipecut.compile(...)`` take the model, the inputs, a few flat shortcuts for the common knobs
(``microbatches``, ``schedule``) and these objects:

- :class:`CaptureOptions`: how the graph is captured;
- :class:`MeasureOptions`: where and how node and stage costs are measured, and the link;
- :class:`PartitionOptions`: the solver, recompute, a split you choose, heavy nodes in pieces;
- :class:`ScheduleOptions`: stages per rank (the microbatches and the schedule are arguments of
  their own, ``microbatches=`` and ``schedule=``: one spelling per knob);
- :class:`DataParallelOptions`: replicas of the pipeline and their engine;
- :class:`TensorParallelOptions`: how each stage splits its layers over a mesh's "tp" dimension;
- :class:`WeightOptions`: where a meta model's weights come from (``compile`` only);
- :class:`RuntimeOptions`: timeouts, host memory, loss reduction, compiled stages (``compile``
  only).

Each normalises what it is given (a kind's name becomes its enum, module classes their names)
so that two equal requests compare equal, and all but the weights (a file or a function, not
data) are recorded in the plan as :class:`Options` (``plan.options``: what was asked, beside
what was chosen), so that a replayed plan carries them.
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ClassVar, Literal

from pipecut.cluster import LINK_LATENCY_MS, Link
from pipecut.core.choices import enum_choice
from pipecut.core.kinds import (
    CaptureMethod,
    DataParallelKind,
    FrameworkKind,
    Partitioner,
    Recompute,
    ScheduleKind,
    TensorShard,
)
from pipecut.errors import InputError

__all__ = [
    "AUTO",
    "EXPORT_TIME_LIMIT",
    "UNBOUNDED",
    "CaptureOptions",
    "DataParallelOptions",
    "IlpSolver",
    "LossReduction",
    "MeasureOptions",
    "Options",
    "PartitionOptions",
    "RuntimeOptions",
    "ScheduleOptions",
    "TensorParallelOptions",
    "WeightOptions",
    "leaf_name",
    "limit_seconds",
    "options_of",
    "requested",
    "schedule_origin",
]

AUTO: Literal["auto"] = "auto"
"""The value that asks the planner to choose (microbatches, schedule, data parallelism)."""

UNBOUNDED: Literal["unbounded"] = "unbounded"
"""``CaptureOptions.time_limit`` for no bound: the symbolic-shape export may take as long as it
needs (a word, not None: None in these options only ever means "not given")."""


class IlpSolver(enum.Enum):
    """The MILP solver behind the memory-aware partitioner, both driven through PuLP."""

    HIGHS = "highs"
    """HiGHS via ``highspy`` (the default): in process, started from the warm-start split."""
    CBC = "cbc"
    """COIN-OR CBC, the binary bundled with PuLP 3 (``PULP_CBC_CMD``, deprecated for PuLP 4)."""


class LossReduction(enum.Enum):
    """How the microbatch losses of a step make the step's loss."""

    MEAN = "mean"
    """``loss_fn`` returns a mean; the step's loss is the mean over microbatches (each / M)."""
    SUM = "sum"
    """``loss_fn`` returns a sum; the step's loss is the sum over microbatches divided by the
    ``normalizer`` given to ``step`` (e.g. the number of valid tokens in the whole batch)."""


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # normalising a frozen dataclass in __post_init__


def _estimated_on(name: str) -> tuple[str, Link]:
    """``MeasureOptions(estimate=name)``'s device profile: its own spelling and interconnect,
    read from the shipped profiles' data (``device_profiles.json``; the estimates that use the
    rest of a profile live in :mod:`pipecut.profile.devices`, above this data layer)."""
    entries = json.loads(resources.files("pipecut").joinpath("device_profiles.json").read_text())["devices"]
    for entry in entries:
        if entry["name"].lower() == name.lower():
            return entry["name"], Link(bandwidth_bytes_per_ms=float(entry["link_bytes_per_s"]) / 1e3,
                                       latency_ms=LINK_LATENCY_MS, measured=False)
    raise InputError(f"MeasureOptions(estimate={name!r}): no such device profile; choose one of "
                     f"{[e['name'] for e in entries]}")


def leaf_name(cls: type | str) -> str:
    """A module class as ``module.QualName`` (a name is kept): how the plan records leaves."""
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


EXPORT_TIME_LIMIT = 30.0
"""Seconds a symbolic-shape ``torch.export`` may take by default (see :class:`CaptureOptions`):
the models of ``examples/zoo.py`` export in 2.5-8 s on a loaded 2-core CPU, a Swin transformer
with symbolic image sizes did not in 10 minutes."""


def limit_seconds(limit: float | Literal["unbounded"]) -> float:
    """A ``time_limit`` as the seconds of a deadline, ``math.inf`` for :data:`UNBOUNDED` (a
    deadline never due), so that the capture code reasons over numbers only.

    >>> limit_seconds(5), limit_seconds(UNBOUNDED)
    (5.0, inf)

    Raises:
        InputError: Anything but finite seconds > 0 or "unbounded" (None included: no bound
            is asked for by name).
    """
    if limit == UNBOUNDED:
        return math.inf
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < math.inf:
        raise InputError(f"CaptureOptions(time_limit={limit!r}): give seconds > 0, or "
                         f"{UNBOUNDED!r} for no bound")
    return float(limit)


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureOptions:
    """How ``plan`` and ``compile`` capture the model's graph (``capture=``).

    Args:
        method: ``"symbolic_trace"`` or ``"export"`` (a :class:`~pipecut.core.kinds.CaptureMethod`);
            "auto" tries both.
        leaf_modules: Module classes, or their ``module.QualName``, captured as one call.
        dynamic_shapes: Export with symbolic dimensions.
        time_limit: Seconds the symbolic-shape export may take, or "unbounded"
            (:data:`UNBOUNDED`).

    Raises:
        InputError: An unknown method, or a time limit that is neither seconds > 0 nor
            "unbounded".
    """

    method: CaptureMethod | Literal["auto"] = AUTO
    """"auto": ``symbolic_trace``, then ``torch.export`` where tracing fails."""
    leaf_modules: tuple[str, ...] = ()
    """Module classes (or their ``module.QualName``) captured as one call, not traced into."""
    dynamic_shapes: bool = True
    """``torch.export`` with symbolic dimensions, so one graph serves smaller microbatches and
    shorter sequences; False: exported at the example's shapes only (faster, and the plan then
    accepts only the planned shapes, checked at every step)."""
    time_limit: float | Literal["unbounded"] = EXPORT_TIME_LIMIT
    """Seconds the symbolic-shape export may take; past them capture logs a warning and exports
    at static shapes instead (as with ``dynamic_shapes=False``). "unbounded" (:data:`UNBOUNDED`):
    no bound, so the graph does not depend on the machine's load. Enforced with ``SIGALRM``, so
    only where capture runs on the main thread (elsewhere: unbounded, with a warning)."""

    def __post_init__(self) -> None:
        if self.method != AUTO:
            _set(self, "method", enum_choice(CaptureMethod, self.method, "capture method", auto=True))
        _set(self, "leaf_modules", tuple(leaf_name(c) for c in self.leaf_modules))
        if self.time_limit != UNBOUNDED:
            _set(self, "time_limit", limit_seconds(self.time_limit))


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasureOptions:
    """Where and how node and stage costs and the link are measured (``measure=``).

    Args:
        device: Where nodes are timed; None: where the inputs are.
        repeats: Timed runs per node.
        warmup: Untimed runs per node first.
        calibrate: ``plan``: time whole stages and scale node costs to them.
        calibration_steps: ``compile``: timed steps of the built pipeline; 0 skips them.
        link: The link between neighbouring stages; None: not given (measured, or the
            context's default).
        estimate: A device profile's name: costs estimated from counted FLOPs and bytes,
            nothing timed.
        framework: The training framework whose run a cluster plan prices; None: not given
            (pipecut's own).

    Raises:
        InputError: ``repeats`` < 1, ``warmup`` or ``calibration_steps`` < 0, or an unknown
            device profile or framework.
    """

    device: str | None = None
    """Where nodes are timed: None is where ``example_inputs`` are (``compile``: each rank's own
    device)."""
    repeats: int = 5
    """Timed runs per node (the median is kept)."""
    warmup: int = 2
    """Untimed runs per node first."""
    calibrate: bool = True
    """``plan``: time the first split's stages whole, scale node costs to them, plan again."""
    calibration_steps: int = 2
    """``compile``: timed steps of the built pipeline on all ranks; 0 skips live calibration."""
    link: Link | None = None
    """The link between neighbouring stages: None is measured (``compile``) or a loopback
    default (``plan``); with ``estimate``, that device's interconnect (:attr:`fixed_link`)."""
    estimate: str | None = None
    """A device profile's name (``"A100-80GB"``; see :mod:`pipecut.profile.devices`): every
    node's cost is estimated from its FLOPs and bytes, counted on fake tensors, on that device's
    roofline, instead of timed here. No clock is read (no node, stage or link is timed), so a
    model, its inputs and these options give the same plan on every run and under any load:
    plans to reproduce, and tests whose numbers depend on the split (the order in which
    gradients are summed). ``plan`` calibrates nothing, ``compile`` runs no calibration steps;
    ``device``, ``repeats``, ``warmup``, ``calibrate`` and ``calibration_steps`` go unused."""
    framework: FrameworkKind | None = None
    """The training framework whose run a cluster plan (``plan(cluster=...)``) prices: its kernels' fitted
    fraction of peak, what its runtime holds and what its memory figure counts
    (``compiler/frameworks.json``). None: not given; see the table of defaults."""

    def __post_init__(self) -> None:
        if self.device is not None:
            _set(self, "device", str(self.device))
        if self.framework is not None:
            _set(self, "framework", enum_choice(FrameworkKind, self.framework, "framework"))
        if self.repeats < 1 or self.warmup < 0 or self.calibration_steps < 0:
            raise InputError(f"MeasureOptions: repeats must be >= 1 and warmup, calibration_steps "
                             f">= 0, got {self.repeats}, {self.warmup}, {self.calibration_steps}")
        if self.estimate is not None:
            _set(self, "estimate", _estimated_on(self.estimate)[0])

    @property
    def fixed_link(self) -> Link | None:
        """The link to plan with without measuring one: the one given, else with ``estimate``
        that device's interconnect; None where it is measured (``compile``) or defaulted."""
        if self.link is not None or self.estimate is None:
            return self.link
        return _estimated_on(self.estimate)[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionOptions:
    """How the graph is cut into stages (``partition=``).

    Args:
        partitioner: ``"dp"`` or ``"ilp"`` (a :class:`~pipecut.core.kinds.Partitioner`); "auto":
            chosen by the problem.
        solver: The ILP's solver (:class:`IlpSolver`).
        ilp_time_limit: Seconds the ILP may spend in total.
        recompute: A :class:`~pipecut.core.kinds.Recompute` level or its name, or "auto".
        split: A split you choose: the modules where stages 1.. begin, or module names per stage.
        heavy_pieces: A node heavier than a stage's share may be computed in row pieces.

    Raises:
        InputError: An unknown partitioner, solver or recompute level.
    """

    partitioner: Partitioner | Literal["auto"] = AUTO
    """"auto": the exact DP for equal devices without memory limits or recompute, else the ILP."""
    solver: IlpSolver = IlpSolver.HIGHS
    ilp_time_limit: float = 5.0
    """Seconds the ILP solver may spend in total."""
    recompute: Recompute | Literal["auto"] = AUTO
    """The most a stage may recompute of its forward in backward: ``NONE``; ``SELECTIVE``, some
    blocks; ``FULL``, the whole stage (the partitioner then picks, per stage and only where
    memory needs it, selective blocks or the whole stage). "auto": ``FULL`` where a device has a
    memory capacity, else ``NONE``; ``plan(cluster=...)`` assumes the level given for every
    stage, and ``SELECTIVE`` for "auto"."""
    split: tuple[str, ...] | tuple[tuple[str, ...], ...] | None = None
    """A split you choose: the modules where stages 1.. begin, or module names per stage."""
    heavy_pieces: bool = True
    """A node heavier than a stage's share (an LM head) may be computed in row pieces."""

    def __post_init__(self) -> None:
        if self.partitioner != AUTO:
            _set(self, "partitioner", enum_choice(Partitioner, self.partitioner, "partitioner", auto=True))
        _set(self, "solver", enum_choice(IlpSolver, self.solver, "ILP solver"))
        if self.recompute != AUTO:
            _set(self, "recompute", enum_choice(Recompute, self.recompute, "recompute", auto=True))
        if self.split is not None:
            _set(self, "split", tuple(s if isinstance(s, str) else tuple(s) for s in self.split))


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleOptions:
    """The schedule's rarer knob (``scheduling=``); the microbatches and the schedule itself
    are ``plan``'s and ``compile``'s own ``microbatches=`` and ``schedule=``.

    Args:
        stages_per_rank: Virtual stages per rank (interleaved 1F1B); None: not given (1; the
            plan's in a replay; a cluster plan weighs V: the table of ``docs/options.md``).

    Raises:
        InputError: ``stages_per_rank`` is not a positive int.
    """

    stages_per_rank: int | None = None
    """Virtual stages per rank (interleaved 1F1B); None: not given (see :data:`pipecut.planning.asked.DEFAULTS`)."""

    def __post_init__(self) -> None:
        n = self.stages_per_rank
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise InputError(f"ScheduleOptions(stages_per_rank={n!r}): a positive int, or None")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataParallelOptions:
    """Replicas of the pipeline and their engine (``data_parallel=``), as asked or, in a plan
    (``plan.data_parallel``), resolved: kind and replicas fixed (:meth:`resolved`).

    Args:
        kind: ``"ddp"``, ``"zero1"``, ``"fsdp"`` (a :class:`~pipecut.core.kinds.DataParallelKind`), "auto",
            or None (not given: no replicas for ``plan``; over a mesh's "dp" dimension of more
            than one replica DDP, or FSDP2 beside a "tp" dimension; every engine weighed for a
            cluster plan: :data:`pipecut.planning.asked.DEFAULTS`).
        replicas: ``plan``: D replicas to plan for; None: not given.

    Raises:
        InputError: An unknown kind, or fewer than 1 replica.
    """

    kind: DataParallelKind | Literal["auto"] | None = None
    """``ddp``/``zero1``/``fsdp`` over a mesh's "dp" dimension, "auto" (choose D × K), None (not given:
    the context's default, :data:`pipecut.planning.asked.DEFAULTS`)."""
    replicas: int | None = None
    """``plan``: D replicas to plan for (``compile`` reads D from the mesh)."""

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind != AUTO:
            try:
                _set(self, "kind", enum_choice(DataParallelKind, self.kind, "data_parallel"))
            except InputError:
                raise InputError(f"unknown data_parallel {self.kind!r}; choose one of "
                                 f"{[k.value for k in DataParallelKind] + [AUTO]} or None") from None
        if self.replicas is not None and (isinstance(self.replicas, bool) or self.replicas < 1):
            raise InputError(f"DataParallelOptions(replicas={self.replicas}): at least 1")

    @classmethod
    def of(cls, given: DataParallelOptions | DataParallelKind | str | None) -> DataParallelOptions:
        """``data_parallel=`` as options: a kind's name (or None) alone is ``DataParallelOptions(kind=...)``."""
        return given if isinstance(given, DataParallelOptions) else cls(kind=given)  # type: ignore[arg-type]

    @classmethod
    def resolved(cls, kind: DataParallelKind | str, replicas: int) -> DataParallelOptions:
        """The options with both fields fixed, as a plan records them (``plan.data_parallel``):
        the engine and the replica count; InputError for "auto" or an unknown kind."""
        if kind == AUTO:
            raise InputError(f"data parallelism resolved needs a kind, one of {[k.value for k in DataParallelKind]}, "
                             f"not 'auto'")
        return cls(kind=kind, replicas=replicas)  # type: ignore[arg-type]  # checked in __post_init__

    @property
    def is_resolved(self) -> bool:
        """Both the engine and the replica count are fixed (what a plan records)."""
        return isinstance(self.kind, DataParallelKind) and self.replicas is not None

    @property
    def resolved_kind(self) -> DataParallelKind:
        """The engine of resolved options (a plan's); InputError where it is not fixed."""
        if not isinstance(self.kind, DataParallelKind):
            raise InputError(f"DataParallelOptions(kind={self.kind!r}) is not resolved to one of "
                             f"{[k.value for k in DataParallelKind]}")
        return self.kind

    @property
    def resolved_replicas(self) -> int:
        """The replica count of resolved options (a plan's); InputError where it is not fixed."""
        if self.replicas is None:
            raise InputError("DataParallelOptions(replicas=None) is not resolved to a count")
        return self.replicas


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelOptions:
    """Tensor parallelism, as ``compile`` and ``plan`` take it (``tensor_parallel=``): how each
    stage splits its layers over the "tp" dimension of ``compile``'s DeviceMesh (see
    :mod:`pipecut.assemble.tensor`), and the group size a cluster plan weighs.

    Args:
        plan: Module patterns (``*`` for one name, as in a Hugging Face ``tp_plan``) → a
            :class:`~pipecut.core.kinds.TensorShard` or its name: ``column`` (the module's
            ``weight`` split by output features, its ``bias`` too), ``row`` (by input features),
            ``vocab`` (an embedding's rows) or ``replicated``. Given, it is the whole split: the
            model's ``tp_plan`` and the graph's pairs are not used.
        sequence_parallel: Split the norms and residual stream along the tokens between split
            regions (Megatron's sequence parallelism: each region closes with a reduce-scatter
            and opens with an all-gather instead of an all-reduce; stage boundaries stay whole).
            None (not given): off under ``compile``, on in a cluster plan (torchtitan's
            default); see :data:`pipecut.planning.asked.DEFAULTS`.
        size: The group size T. ``compile`` takes it from the DeviceMesh's "tp" dimension and
            records it (None: no "tp" dimension); ``plan(cluster=...)`` weighs every size the
            heads and a node allow where it is None, else plans that size.

    Raises:
        InputError: An unknown kind, a size below 1, or a sequence_parallel not a bool or None.
    """

    plan: tuple[tuple[str, TensorShard], ...] = ()
    """(module pattern, kind) pairs, sorted by pattern; a mapping given is stored so."""
    sequence_parallel: bool | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise InputError(f"TensorParallelOptions(sequence_parallel={self.sequence_parallel!r}): True, False "
                             f"or None (not given)")
        given = self.plan.items() if isinstance(self.plan, Mapping) else self.plan
        _set(self, "plan", tuple(sorted((str(m), enum_choice(TensorShard, k, f"tensor-parallel kind of {m!r}"))
                                        for m, k in given)))
        if self.size is not None and (isinstance(self.size, bool) or self.size < 1):
            raise InputError(f"TensorParallelOptions(size={self.size}): at least 1")

    @classmethod
    def of(cls, given: TensorParallelOptions | int | str) -> TensorParallelOptions:
        """``tensor_parallel=`` as options: a size alone (an int, or "auto" for none fixed) is
        ``TensorParallelOptions(size=...)``."""
        if isinstance(given, TensorParallelOptions):
            return given
        if given == AUTO:
            return cls()
        if isinstance(given, bool) or not isinstance(given, int):
            raise InputError(f"tensor_parallel={given!r}: TensorParallelOptions, a group size (an int) or 'auto'")
        return cls(size=given)


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightOptions:
    """Where a meta model's weights come from (``compile``'s ``weights=``).

    Args:
        source: A ``.safetensors`` file, a ``save_pretrained`` or pipecut checkpoint
            directory, or a state dict.
        init: Without ``source``: ``init(fqn, module)`` fills a meta model's new tensors.
        seed: Seeds each module's initialisation.

    Raises:
        InputError: Not here: ``compile`` refuses a source it cannot read, or one whose names
            the model does not have.
    """

    source: str | os.PathLike[str] | Mapping[str, Any] | None = None
    """A ``.safetensors`` file, a ``save_pretrained`` or pipecut checkpoint directory, or a state
    dict; each rank reads its stage's tensors from it."""
    init: Callable[[str, Any], Any] | None = None
    """Without ``source``: ``init(fqn, module)`` fills a meta model's new tensors."""
    seed: int = 0
    """Seeds each module's initialisation (with its name), so values do not depend on K."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeOptions:
    """How the stages run (``compile``'s ``runtime=``; ``plan`` prices ``compile_stages``).

    Args:
        timeout: Seconds every collective and transfer may wait.
        lean_host_memory: CPU ranks: give freed blocks back to the system at once.
        loss_reduction: How microbatch losses make the step's loss (:class:`LossReduction`).
        compile_stages: True, False or "auto": run the stages through ``torch.compile``.

    Raises:
        InputError: An unknown loss reduction, or ``compile_stages`` not True, False or "auto".
    """

    timeout: float = 300.0
    """Seconds every collective and transfer may wait before the rank fails."""
    lean_host_memory: bool = False
    """CPU ranks: give every freed block of 1 MiB or more back at once (peak RSS follows the
    plan, steps slower)."""
    loss_reduction: LossReduction = LossReduction.MEAN
    compile_stages: bool | Literal["auto"] = False
    """Run each stage module through ``torch.compile`` (see :mod:`pipecut.runtime.execution.compiled`);
    "auto": the live calibration steps time the stages eager and compiled and keep compiled
    where the saving pays for the compile (see :mod:`pipecut.profile.compiled`)."""

    def __post_init__(self) -> None:
        _set(self, "loss_reduction", enum_choice(LossReduction, self.loss_reduction, "loss_reduction"))
        if self.compile_stages not in (True, False, AUTO):
            raise InputError(f"RuntimeOptions(compile_stages={self.compile_stages!r}): use True, False "
                             f"or {AUTO!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """Everything asked of ``plan``/``compile`` but the weights; ``plan.options`` records it.

    Args:
        microbatches: A count, "auto", or None (not given).
        schedule: A :class:`~pipecut.core.kinds.ScheduleKind` or its name, "auto", or None (not
            given).
        capture: :class:`CaptureOptions`.
        measure: :class:`MeasureOptions`.
        partition: :class:`PartitionOptions`.
        scheduling: :class:`ScheduleOptions`.
        data_parallel: :class:`DataParallelOptions`.
        runtime: :class:`RuntimeOptions`.
        tensor_parallel: :class:`TensorParallelOptions`.

    Raises:
        InputError: An unknown schedule, or microbatches that are not a positive int or "auto".
    """

    microbatches: int | Literal["auto"] | None = None
    """Microbatches per step: a count, "auto" (the planner chooses), or None (not given: "auto"
    when planning, the plan's when one is replayed)."""
    schedule: ScheduleKind | Literal["auto"] | None = None
    """The schedule: a kind, "auto" (chosen with the microbatches), or None (not given: "auto"
    beside "auto" microbatches, GPipe beside a count, the plan's when one is replayed)."""
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    measure: MeasureOptions = field(default_factory=MeasureOptions)
    partition: PartitionOptions = field(default_factory=PartitionOptions)
    scheduling: ScheduleOptions = field(default_factory=ScheduleOptions)
    data_parallel: DataParallelOptions = field(default_factory=DataParallelOptions)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    tensor_parallel: TensorParallelOptions = field(default_factory=TensorParallelOptions)

    GROUPS: ClassVar[tuple[str, ...]] = (
        "capture", "measure", "partition", "scheduling", "data_parallel", "runtime", "tensor_parallel")

    def __post_init__(self) -> None:
        if self.schedule is not None and self.schedule != AUTO:
            _set(self, "schedule", enum_choice(ScheduleKind, self.schedule, "schedule", auto=True))
        m = self.microbatches
        if m is not None and m != AUTO and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise InputError(f"microbatches must be a positive int or 'auto', got {m!r}")


def requested(
    *,
    microbatches: int | Literal["auto"] | None = None,
    schedule: str | ScheduleKind | None = None,
    data_parallel: DataParallelOptions | DataParallelKind | str | None = None,
    groups: Mapping[str, Any],
) -> dict[str, Any]:
    """The options of one ``plan``/``compile`` call, name → value (``weights`` too where
    given): the groups given (None: the defaults), the microbatches and the schedule (None: not
    given), and the data parallelism (a kind's name alone: its options)."""
    empty = Options()  # each group's defaults, from its field: GROUPS is the one list of groups
    out: dict[str, Any] = {g: groups.get(g) or getattr(empty, g) for g in Options.GROUPS if g != "data_parallel"}
    out["weights"] = groups.get("weights") or WeightOptions()
    out["data_parallel"] = DataParallelOptions.of(data_parallel)
    out["microbatches"], out["schedule"] = microbatches, schedule
    return out


def options_of(groups: Mapping[str, Any]) -> Options:
    """The recorded part of :func:`requested`'s groups (all but the weights)."""
    return Options(microbatches=groups["microbatches"], schedule=groups["schedule"],
                   **{g: groups[g] for g in Options.GROUPS})


def schedule_origin(options: Options | None) -> str:
    """How a refusal names a plan's schedule that was not asked for by name, from what the plan
    records as asked (``plan.options``): " (chosen by schedule='auto')", or the default that
    stood for a schedule left out; empty where one was asked (or nothing is recorded), so that
    a refusal names what the user asked for, not a default they never saw.

    >>> schedule_origin(Options(schedule="1f1b")), schedule_origin(Options(schedule=AUTO))
    ('', " (chosen by schedule='auto')")
    >>> schedule_origin(Options(microbatches=4))
    ' (the default beside microbatches=4)'
    """
    if options is None or isinstance(options.schedule, ScheduleKind):
        return ""
    if options.schedule == AUTO:
        return f" (chosen by schedule={AUTO!r})"
    if options.data_parallel.kind == AUTO:  # compile's replicas chosen beside GPipe
        return f" (the default beside data_parallel={AUTO!r})"
    if isinstance(options.microbatches, int):
        return f" (the default beside microbatches={options.microbatches})"
    return f" (chosen by schedule={AUTO!r}, the default)"
