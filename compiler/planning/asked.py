"""What a call was asked, resolved once: each option left out takes its context's default.

``pipecut.plan``, ``pipecut.compile`` (planning on rank 0, or replaying ``plan=``) and a cluster
plan (``plan(cluster=...)``, :func:`~pipecut.planning.cluster.plan.plan_cluster`) take the same
option objects (:mod:`pipecut.options`). In them, a field at its declared default, None for most, means "not
given", and nothing else. :func:`resolve` turns the options into one :class:`Resolved`, in
which nothing is "not given". Each value is either the one asked or the default that
:data:`DEFAULTS` names for the context. The record also says where each default came from
(:meth:`Resolved.origin`), so that a refusal names what the user asked for, not a default they
never saw.

A replayed plan also fills the option groups a ``compile(plan=...)`` call left out from what
the plan records as asked (:func:`replay_groups`).

:data:`DEFAULTS` is the only table of defaults. Each row is a rule and the sentence that
documents it. ``docs/options.md`` prints the table (:func:`defaults_table`), and a test keeps the
two equal. Another test fails when an options field that may be left out has no row.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pipecut.cluster import Link
from pipecut.core.kinds import (
    CaptureMethod,
    DataParallelKind,
    FrameworkKind,
    Recompute,
    ScheduleKind,
)
from pipecut.errors import InputError
from pipecut.ir import Plan
from pipecut.options import AUTO, Options, ScheduleOptions, TensorParallelOptions
from pipecut.passes.partition.solve import DEFAULT_LINK, as_schedule

__all__ = ["DEFAULTS", "FIELDS", "NO_REPLICAS", "Context", "Default", "Resolved", "defaults_table", "mesh_sizes", "replanned",
           "replay_groups", "resolve", "tensor_group"]

NO_REPLICAS: Literal["none"] = "none"
"""A resolved ``data_parallel``: one replica, no engine to keep replicas in step."""


class Context(enum.Enum):
    """Where the options were asked."""

    PLAN = "plan"
    """``pipecut.plan(model, inputs, devices)``: one pipeline's plan."""
    COMPILE = "compile"
    """``pipecut.compile`` without ``plan=``: rank 0 plans, every rank builds."""
    REPLAY = "replay"
    """``pipecut.compile(plan=...)``: the plan's own settings run."""
    CLUSTER = "cluster"
    """``pipecut.plan(cluster=...)`` or ``plan_cluster``: a whole run for a cluster not here."""


FIELDS: Mapping[str, tuple[str, ...]] = {
    "microbatches": ("microbatches",),
    "schedule": ("schedule",),
    "stages_per_rank": ("scheduling", "stages_per_rank"),
    "recompute": ("partition", "recompute"),
    "sequence_parallel": ("tensor_parallel", "sequence_parallel"),
    "data_parallel": ("data_parallel", "kind"),
    "link": ("measure", "link"),
    "capture_method": ("capture", "method"),
    "framework": ("measure", "framework"),
}
"""Each resolved name → where :class:`~pipecut.options.Options` holds it (group, field)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Facts:
    """What a default may depend on besides the options: the plan replayed and the mesh."""

    plan: Plan | None = None
    mesh: Mapping[str, int] = field(default_factory=dict)
    """The sizes of the DeviceMesh's named dimensions ("dp", "pp", "tp"); empty without one."""
    asked: Options = field(default_factory=Options)


Rule = Callable[[Facts], tuple[Any, str]]
"""A default: (value, where it came from, as a refusal says it after the value)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Default:
    """One row of the table: what ``name`` left out means in ``context``."""

    name: str
    context: Context
    says: str
    """The row as ``docs/options.md`` prints it."""
    rule: Rule


def _const(value: Any, why: str) -> Rule:
    return lambda _facts: (value, why)


def _planned(attr: str) -> Rule:
    def rule(facts: Facts) -> tuple[Any, str]:
        assert facts.plan is not None, "a replay resolves against its plan"
        return getattr(facts.plan, attr), "the replayed plan's"
    return rule


def _schedule(facts: Facts) -> tuple[Any, str]:
    m = facts.asked.microbatches
    if m is None or m == AUTO:
        return AUTO, f"chosen by schedule={AUTO!r}, the default"
    return ScheduleKind.GPIPE, f"the default beside microbatches={m}"


def _recorded_sequence(facts: Facts) -> tuple[Any, str]:
    plan = facts.plan
    if plan is not None and plan.run is not None and plan.placement is not None and plan.placement.tensor_parallel > 1:
        return plan.run.sequence_parallel, "the replayed cluster plan's run"  # what its stages were priced with
    recorded = plan.options if plan is not None else None
    if recorded is None or recorded.tensor_parallel.sequence_parallel is None:
        return False, "the default"
    return recorded.tensor_parallel.sequence_parallel, "recorded in the replayed plan's options"


def _mesh_engine(facts: Facts) -> tuple[Any, str]:
    replicas, split = facts.mesh.get("dp", 1), "tp" in facts.mesh
    if replicas <= 1:  # nothing to keep in step: no engine unless one is asked (as torchtitan)
        return NO_REPLICAS, ""
    if split:  # DDP does not reduce the DTensor gradients of split stages
        return DataParallelKind.FSDP, "the default for a mesh with a 'dp' dimension and tensor parallelism"
    return DataParallelKind.DDP, "the default for a mesh with a 'dp' dimension"


def _fixed_link(facts: Facts) -> tuple[Any, str]:
    """The estimated device's link, else the loopback figure (``compile`` measures one when it plans)."""
    return facts.asked.measure.fixed_link or DEFAULT_LINK, "the default"


_BOTH = (Context.PLAN, Context.COMPILE)


def _rows(name: str, *rows: tuple[tuple[Context, ...], str, Rule]) -> tuple[Default, ...]:
    return tuple(Default(name=name, context=c, says=says, rule=rule) for contexts, says, rule in rows for c in contexts)


DEFAULTS: tuple[Default, ...] = (
    *_rows("microbatches",
           (_BOTH, '"auto": the planner chooses', _const(AUTO, f"chosen by microbatches={AUTO!r}, the default")),
           ((Context.REPLAY,), "the plan's", _planned("microbatches")),
           ((Context.CLUSTER,), "1", _const(1, "the default"))),
    *_rows("schedule",
           (_BOTH, '"auto" beside "auto" microbatches; GPipe beside a count', _schedule),
           ((Context.REPLAY,), "the plan's", _planned("schedule")),
           ((Context.CLUSTER,), "1F1B", _const(ScheduleKind.ONE_F_ONE_B, "the default"))),
    *_rows("stages_per_rank",
           (_BOTH, "1", _const(1, "the default")),
           ((Context.REPLAY,), "the plan's", _planned("stages_per_rank")),
           ((Context.CLUSTER,), '"auto": interleaving weighs 2 and every V that divides the blocks',
            _const(AUTO, "the default"))),
    *_rows("recompute",
           (_BOTH, '"auto": each stage recomputes what it must to fit', _const(AUTO, "the default")),
           ((Context.REPLAY,), "the plan's stages' (the value goes unused)", _const(AUTO, "the replayed plan's")),
           ((Context.CLUSTER,), "selective, for every stage (torchtitan's default)",
            _const(Recompute.SELECTIVE, f"the default for recompute={AUTO!r}"))),
    *_rows("sequence_parallel",
           (_BOTH, "off", _const(False, "the default")),
           ((Context.REPLAY,), "a cluster plan's run's (`plan.run.sequence_parallel`), else recorded in the "
            "plan's options, else off", _recorded_sequence),
           ((Context.CLUSTER,), "on (torchtitan's default)", _const(True, "the default for a cluster plan"))),
    *_rows("data_parallel",
           ((Context.PLAN,), "none: one pipeline", _const(NO_REPLICAS, "")),
           ((Context.COMPILE, Context.REPLAY),
            "over a mesh's \"dp\" dimension of more than one replica DDP, FSDP2 beside a \"tp\" dimension; else none",
            _mesh_engine),
           ((Context.CLUSTER,), '"auto": every D and engine weighed', _const(AUTO, "the default"))),
    *_rows("link",
           ((Context.PLAN,), "the interconnect of `MeasureOptions(estimate=)`'s device, else 2 GB/s and 50 µs",
            _fixed_link),
           ((Context.COMPILE,), "the interconnect of `MeasureOptions(estimate=)`'s device, else measured between "
            "the ranks", _fixed_link),
           ((Context.REPLAY,), "the plan's", _planned("link")),
           ((Context.CLUSTER,), "the cluster's links price every cut (the value goes unused)",
            _const(DEFAULT_LINK, "the default"))),
    *_rows("capture_method",
           ((*_BOTH, Context.CLUSTER), '"auto": symbolic_trace, then torch.export', _const(AUTO, "the default")),
           ((Context.REPLAY,), "the plan's", _planned("capture"))),
    *_rows("framework",
           ((*_BOTH, Context.REPLAY), "pipecut's own (the value goes unused: a local plan times or estimates "
            "pipecut's runtime)", _const(FrameworkKind.PIPECUT, "the default")),
           ((Context.CLUSTER,), "pipecut's own runtime's run", _const(FrameworkKind.PIPECUT, "the default"))),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Resolved:
    """What one call runs with, nothing left out: "auto" only where the planner chooses."""

    context: Context
    microbatches: int | Literal["auto"]
    schedule: ScheduleKind | Literal["auto"]
    stages_per_rank: int | Literal["auto"]
    recompute: Recompute | Literal["auto"]
    sequence_parallel: bool
    data_parallel: DataParallelKind | Literal["auto", "none"]
    """The replicas' engine; :data:`NO_REPLICAS` for one replica."""
    link: Link
    capture_method: CaptureMethod | Literal["auto"]
    framework: FrameworkKind
    """The training framework whose run a cluster plan prices."""
    defaulted: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Each name that took its context's default → where from (see :meth:`origin`)."""

    @property
    def auto(self) -> bool:
        """The planner chooses the microbatches or the schedule (before capture, at its count)."""
        return AUTO in (self.microbatches, self.schedule)

    def origin(self, name: str) -> str:
        """Where a defaulted value came from ("the default for a mesh with a 'dp' dimension"),
        for a refusal to say after the value; empty for a value the call passed."""
        return self.defaulted.get(name, "")


def mesh_sizes(devices: Any) -> dict[str, int]:
    """The sizes of a DeviceMesh's named dimensions; empty for anything else."""
    names = getattr(devices, "mesh_dim_names", None) or ()
    return {name: int(devices[name].size()) for name in names}


def resolve(options: Options, context: Context, *, plan: Plan | None = None, devices: Any = None) -> Resolved:
    """``options`` as ``context`` runs them: each name of :data:`FIELDS` as given, else its
    row of :data:`DEFAULTS`. ``plan``: the plan replayed (:attr:`Context.REPLAY`);
    ``devices``: ``compile``'s, whose DeviceMesh dimensions the replicas' default reads.

    Raises:
        InputError: A value the context cannot take ("auto" microbatches for a cluster plan,
            or replicas asked of devices without a "dp" dimension).
    """
    if context is Context.REPLAY and plan is None:
        raise InputError("resolve(context=REPLAY) needs the plan it replays")
    facts = Facts(plan=plan, mesh=mesh_sizes(devices), asked=options)
    values: dict[str, Any] = {}
    defaulted: dict[str, str] = {}
    for name, where in FIELDS.items():
        given = _read(options, where)
        if given is not None and given != _declared(where):
            values[name] = given
            continue
        value, why = _row(name, context).rule(facts)
        values[name] = value
        defaulted[name] = why
    _check(values, context, facts, options)
    if values["schedule"] != AUTO:
        values["schedule"] = as_schedule(values["schedule"])
    return Resolved(context=context, defaulted=defaulted, **values)


def replay_groups(plan: Plan | None, **given: Any) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    """``compile(plan=...)``'s option groups (``capture``, ``runtime``, ``tensor_parallel``, as
    given; None: not given), each left out filled from what the plan records as asked: how it
    was captured and run, and the tensor split (its size is this run's mesh's). Returns the
    groups and, for each one filled, where it came from (``Request.unasked``), so a refusal names
    the replayed plan rather than an option the user never passed."""
    recorded = plan.options if plan is not None else None
    if recorded is None:
        return dict(given), ()
    split = recorded.tensor_parallel
    carried = {"capture": recorded.capture, "runtime": recorded.runtime,
               # None or False: off, nothing to carry
               "tensor_parallel": TensorParallelOptions(plan=split.plan, sequence_parallel=split.sequence_parallel)
               if split.plan or split.sequence_parallel else None}
    out = {name: carried[name] if value is None else value for name, value in given.items()}
    whence = tuple((name, "recorded in the replayed plan's options") for name, value in given.items()
                   if value is None and carried[name] is not None)
    return out, whence


def tensor_group(options: TensorParallelOptions | None, devices: Any) -> TensorParallelOptions:
    """``compile``'s ``tensor_parallel=`` with the size of the mesh's "tp" dimension recorded
    (None without one): compile reads T from its devices.

    Raises:
        InputError: A size that is not the mesh's, or a split ``plan`` without a "tp" dimension.
    """
    options = options or TensorParallelOptions()
    size = mesh_sizes(devices).get("tp")
    if options.size is not None and options.size != size:
        raise InputError(f"TensorParallelOptions(size={options.size}) but the devices give "
                         f"{'no tp dimension' if size is None else f'a tp dimension of {size}'}; compile reads "
                         f"the size from the DeviceMesh: leave size out or match it")
    if options.plan and size is None:
        raise InputError("TensorParallelOptions(plan=...) needs a DeviceMesh with a 'tp' dimension as devices")
    return dataclasses.replace(options, size=size)


def replanned(options: Options) -> Options:
    """``options`` for replaying a plan ``compile`` made itself (after its timed steps, or D × K
    chosen by ``data_parallel="auto"``): the microbatches, schedule, stages per rank and link are
    the plan's, so they are left out (None, or not given)."""
    return dataclasses.replace(options, microbatches=None, schedule=None, scheduling=ScheduleOptions(),
                               measure=dataclasses.replace(options.measure, link=None))


def defaults_table() -> str:
    """:data:`DEFAULTS` as the markdown table ``docs/options.md`` prints."""
    head = ["| option | " + " | ".join(f"`{c.value}`" for c in Context) + " |",
            "| --- |" + " --- |" * len(Context)]
    rows = []
    for name, (group, *rest) in FIELDS.items():
        where = f"{group}.{rest[0]}" if rest else group
        cells = " | ".join(_row(name, c).says for c in Context)
        rows.append(f"| `{name}` (`{where}`) | {cells} |")
    return "\n".join(head + rows)


def _row(name: str, context: Context) -> Default:
    return next(d for d in DEFAULTS if d.name == name and d.context is context)


def _read(options: Options, where: tuple[str, ...]) -> Any:
    value: Any = options
    for part in where:
        value = getattr(value, part)
    return value


def _declared(where: tuple[str, ...]) -> Any:
    """A field's declared default: the value that means "not given" (None for most)."""
    owner: Any = Options
    for part in where[:-1]:
        owner = next(f for f in dataclasses.fields(owner) if f.name == part).default_factory  # type: ignore[misc]
    f = next(f for f in dataclasses.fields(owner) if f.name == where[-1])
    return f.default


def _check(values: Mapping[str, Any], context: Context, facts: Facts, options: Options) -> None:
    kind = options.data_parallel.kind
    if context is Context.CLUSTER and values["microbatches"] == AUTO:
        raise InputError("plan(cluster=...) needs microbatches as a value, not 'auto'")
    if context in (Context.COMPILE, Context.REPLAY) and kind is not None and kind != AUTO and "dp" not in facts.mesh:
        raise InputError(f"data_parallel={getattr(kind, 'value', kind)!r} needs replicas: pass a DeviceMesh with "
                         f"dimensions ('dp', 'pp') as devices, or leave data_parallel=None")
