"""The plan IR: frozen dataclasses, names not objects, JSON that diffs well.

The plan is the only thing that crosses from compile time to run time. It holds the cost table
(so anyone can recompute the partition from it), the stages, the cut edges and the prediction.
Times are per microbatch in milliseconds; shapes are per microbatch. (The module is ``pipecut.ir``,
not ``pipecut.plan``: that name is the planning function. The kinds the plan names live in
:mod:`pipecut.core.kinds`, the link and cluster in :mod:`pipecut.cluster`; import them from there.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from pipecut.cluster import Cluster, ClusterPlacement, Layout, Link, RunPrediction
from pipecut.core.kinds import (
    CaptureMethod,
    CostSource,
    DataParallelKind,
    LeafKind,
    NodeOp,
    Partitioner,
    Recompute,
    ScheduleKind,
)
from pipecut.errors import PlanError
from pipecut.options import DataParallelOptions, Options
from pipecut.schedules.format import rank_of, stages_on

__all__ = [
    "FORMAT_VERSION",
    "ChunkedNode",
    "DeviceSpec",
    "Edge",
    "Leaf",
    "NodeCost",
    "Plan",
    "Predicted",
    "ReplicaCandidate",
    "Solver",
    "Stage",
    "TiedGroup",
]

FORMAT_VERSION = 6
"""2 added ``options``; 3 records ``options.partition.recompute`` as a ``Recompute`` level or
"auto"; 4 records the microbatches and schedule asked as ``options.microbatches`` and
``options.schedule`` (they were ``options.scheduling.microbatches``/``kind``); 5 writes "auto"
where ``options.capture.method`` and ``options.partition.partitioner`` were null; 6 writes
"unbounded" where ``options.capture.time_limit`` was null. Older plans are read as version 6
(:func:`pipecut.schema.upgraded`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Leaf:
    """One leaf of a node's output after pytree flattening."""

    kind: LeafKind
    shape: tuple[int, ...] = ()
    dtype: str = ""
    requires_grad: bool = False
    """True when the tensor depends on a parameter, so its gradient crosses cuts backwards."""
    value: Any = None
    """JSON encoding of a non-tensor leaf (see ``pipecut.core.cut_values``); None if not encodable."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeCost:
    """One row of the cost table: a node of the captured graph, in topological order."""

    name: str
    op: NodeOp
    target: str
    module: str = ""
    """Module path the node came from (for grouping and coarsening)."""
    inputs: tuple[str, ...] = ()
    """Names of the nodes whose values this node reads."""
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    output_bytes: int = 0
    saved_bytes: int | None = None
    """Bytes autograd keeps for backward on this node's account, measured while profiling:
    its output where some node saves it, and what the node saves of its own (a softmax's
    result, a dropout mask). None where not measured (estimated rows, hand-made tables)."""
    param_bytes: int = 0
    parameters: tuple[str, ...] = ()
    """Canonical FQNs of the parameters this node reads directly."""
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    leaves: tuple[Leaf, ...] = ()
    treespec: str | None = None
    """Serialized pytree structure of the output (``torch.utils._pytree.treespec_dumps``)."""
    source: CostSource = CostSource.MEASURED
    """Whether forward_ms/backward_ms were measured or estimated for a device that is not here."""
    cuttable: bool = True
    """False for a value that must stay on the stage that made it: a node run under
    ``torch.no_grad()`` before the detach that ends its block (cut there, zero gradients would
    flow back into weights the plain model never gives a gradient)."""
    rebuilt: bool = False
    """True for a value that never crosses a cut: a parameter-free, deterministic function of
    the model inputs and buffers that every stage reading it computes again (a causal mask,
    rotary tables), chosen where that costs less than sending it
    (:func:`pipecut.passes.partition.rebuild.mark_rebuilt`)."""

    def __post_init__(self) -> None:
        if self.forward_ms < 0 or self.backward_ms < 0:
            raise ValueError(f"node {self.name}: negative time")

    @property
    def kept_bytes(self) -> int:
        """Activation bytes this node costs until backward: measured where known, else its
        whole output (the safe side)."""
        return self.saved_bytes if self.saved_bytes is not None else self.output_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: int | None = None
    """Capacity for the memory check; None means unlimited."""
    speed: float = 1.0
    """Relative speed: node times measured on the profiling device are divided by it."""

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError(f"device {self.name}: speed must be > 0, got {self.speed}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    index: int
    device: str
    nodes: tuple[str, ...]
    parameters: tuple[str, ...]
    recompute: Recompute = Recompute.NONE
    recomputed: tuple[str, ...] = ()
    """``Recompute.SELECTIVE``: the nodes whose forward runs again in backward (whole blocks,
    runs of consecutive nodes); their activations are not kept. Empty otherwise."""
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    weight_ms: float = 0.0
    """The part of ``backward_ms`` that computes weight gradients (estimated as half the
    backward of the nodes that read parameters); zero-bubble schedules run it separately."""
    comm_ms: float = 0.0
    param_bytes: int = 0
    activation_bytes: int = 0
    """Bytes of activations one microbatch keeps alive until its backward."""
    peak_memory_bytes: int = 0
    send_bytes: int = 0
    recv_bytes: int = 0
    inputs: tuple[str, ...] = ()
    """Values received from the previous stage, in wire order."""
    outputs: tuple[str, ...] = ()
    """Values sent to the next stage, in wire order."""

    def __post_init__(self) -> None:
        if bool(self.recomputed) != (self.recompute is Recompute.SELECTIVE):
            raise ValueError(
                f"stage {self.index}: recompute {self.recompute.value} with {len(self.recomputed)} "
                f"recomputed nodes; 'selective' names the nodes it recomputes, the others none"
            )
        stray = sorted(set(self.recomputed) - set(self.nodes))
        if stray:
            raise ValueError(f"stage {self.index} recomputes node(s) {stray[:5]} it does not hold")

    @property
    def time_ms(self) -> float:
        """Predicted time of one microbatch's forward and backward, communication included."""
        return self.forward_ms + self.backward_ms + self.comm_ms


@dataclass(frozen=True, kw_only=True, slots=True)
class Edge:
    src_node: str
    src_stage: int
    dst_stages: tuple[int, ...]
    shape: tuple[int, ...] | None
    dtype: str | None
    bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkedNode:
    """A node of the captured graph that the plan computes in row pieces (see
    :mod:`pipecut.passes.rewrite.chunk_rows`): a node heavier than a stage's share, so that its pieces
    can land on different stages. The plan's cost table and stages are those of the rewritten
    graph; its fingerprint is the original graph's."""

    node: str
    """The node's name in the captured (original) graph."""
    pieces: int
    """How many row chunks (along dim -2, the tokens) its first operand is cut into."""

    def __post_init__(self) -> None:
        if self.pieces < 2:
            raise PlanError(f"chunked node {self.node!r}: pieces must be at least 2, got {self.pieces}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TiedGroup:
    """A parameter used by several stages: kept on each, gradients summed after backward."""

    fqn: str
    """Canonical name (the first of its aliases in ``named_parameters``)."""
    stages: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Predicted:
    step_ms: float
    bubble_fraction: float
    bottleneck_stage: int
    stage_ms: tuple[float, ...] = ()
    single_device_ms: float = 0.0
    optimum_step_ms: float = 0.0
    """The predicted step of pipecut's own split for the same devices and schedule: equal to
    ``step_ms`` unless the split was given (then the difference is what the choice costs; the
    partitioner minimises the slowest stage, so a given split can come out ahead in the
    simulated step)."""
    """Forward + backward of the whole batch on one device (for the speedup estimate)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleCandidate:
    """One (microbatches, schedule) pair the planner weighed when asked to choose ("auto")."""

    microbatches: int
    schedule: ScheduleKind
    step_ms: float | None
    """Predicted step time of the best split for this pair; None where nothing fits."""
    note: str = ""
    """Why a pair was ruled out, or "chosen"."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaCandidate:
    """One way of spreading N devices that ``data_parallel="auto"`` weighed: D replicas of a
    K-stage pipeline (see :mod:`pipecut.planning.replicas`)."""

    replicas: int
    stages: int
    step_ms: float | None
    """Predicted step of the whole batch (pipeline plus each stage's gradient all-reduce);
    None where the shape was ruled out."""
    per_stage: tuple[int, ...] = ()
    """Replicas of each stage for an uneven (per-stage) candidate, empty for D × K; a
    prediction only: the runtime replicates every stage equally."""
    layout: Layout | None = None
    """On a cluster: how the D × K GPUs were laid onto nodes for this prediction."""
    note: str = ""
    """"chosen", or why the shape was ruled out or cannot run."""
    tensor_parallel: int = 1
    """On a cluster: T, the GPUs of one node that split each stage (D × K × T GPUs in all)."""
    sharding: DataParallelKind | None = None
    """The replicas' engine this prediction is for (DDP, ZeRO-1 or FSDP2); None: one replica,
    or a plan written before the engine was weighed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Solver:
    method: Partitioner
    solve_ms: float = 0.0
    optimal: bool = True
    detail: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class InputShape:
    """The per-microbatch shapes one tensor input may take at run time without re-planning.

    Dimension ``d`` may be anything from ``min_shape[d]`` to ``max_shape[d]``; where the two
    are equal it is fixed. ``max_shape`` is the planned (profiled) microbatch shape, so memory
    and time predictions are upper bounds; dimension 0 is the microbatch size, which a smaller
    (or uneven) last batch lowers. Dimensions with the same non-empty ``symbols`` entry (from
    torch.export, e.g. the sequence length of ``input_ids`` and ``attention_mask``) must be
    equal to each other.
    """

    name: str
    dtype: str
    min_shape: tuple[int, ...]
    max_shape: tuple[int, ...]
    symbols: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.min_shape) != len(self.max_shape) or any(
            not 0 <= lo <= hi for lo, hi in zip(self.min_shape, self.max_shape)
        ):
            raise PlanError(f"input {self.name}: bad shape range {self.min_shape}..{self.max_shape}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    fingerprint: str
    capture: CaptureMethod
    schedule: ScheduleKind
    microbatches: int
    batch_size: int
    inputs: tuple[str, ...]
    """Names of the graph's input placeholders, in the order inputs are flattened."""
    nodes: tuple[NodeCost, ...]
    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    devices: tuple[DeviceSpec, ...]
    link: Link
    predicted: Predicted
    solver: Solver
    tied: tuple[TiedGroup, ...] = ()
    stages_per_rank: int = 1
    """Stages per rank: several for interleaved 1F1B (stage s on rank s mod K) and two for ZBV
    (rank r runs stages r and 2K - 1 - r); :meth:`rank_of` says which."""
    candidates: tuple[ScheduleCandidate, ...] = ()
    """With microbatches="auto" or schedule="auto": every pair considered and its prediction."""
    data_parallel: DataParallelOptions | None = None
    """Replicas of every stage and their engine, resolved (kind and replicas fixed; read them
    as ``resolved_kind``/``resolved_replicas``); ``batch_size`` is then one replica's share of a
    global batch of ``batch_size * data_parallel.replicas``."""
    replica_candidates: tuple[ReplicaCandidate, ...] = ()
    """With data_parallel="auto": every D × K shape considered and its prediction."""
    accepts: tuple[InputShape, ...] = ()
    """Shapes each tensor input may take at run time (see :class:`InputShape`). Empty in plans
    made before this field existed: then only the planned shapes are accepted."""
    chunked: tuple[ChunkedNode, ...] = ()
    """Nodes of the captured graph computed in row pieces (a heavy LM head): the runtime applies
    :func:`pipecut.passes.rewrite.chunk_rows.chunk_rows` with these to the graph it captures (after
    checking ``fingerprint`` against it) before splitting it into stages."""
    cluster: Cluster | None = None
    """The cluster planned for (``pipecut.planning.cluster.plan.plan_cluster``); None for other plans."""
    placement: ClusterPlacement | None = None
    """On ``cluster``: which GPU holds which stage of which replica."""
    run: RunPrediction | None = None
    """On ``cluster``: the predicted step, tokens/s per GPU, MFU and memory of the whole run."""
    options: Options | None = None
    """What was asked of ``plan``/``compile`` (the weights aside), beside what the fields above
    say was chosen; None in plans made before version 2 or from a bare cost table."""
    profiled_on: str = ""
    """The device the node costs were measured on (``"cuda:0"``, ``"cpu"``); empty where the
    costs were given or estimated rather than measured here."""
    format_version: int = FORMAT_VERSION
    pipecut_version: str = ""
    torch_version: str = ""
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    __pydantic_config__: ClassVar[dict[str, Any]] = {
        "strict": True, "extra": "forbid", "use_attribute_docstrings": True,
        "ser_json_inf_nan": "constants",
    }
    """How :mod:`pipecut.schema` (pydantic) reads plan JSON; the nested dataclasses inherit it."""

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise PlanError(
                f"plan format_version {self.format_version} is not supported by this pipecut "
                f"(it reads version {FORMAT_VERSION}); re-plan with pipecut.plan(...)"
            )
        if len(self.stages) != len(self.devices):
            raise PlanError(f"{len(self.stages)} stages but {len(self.devices)} devices")
        if self.stages_per_rank < 1 or len(self.stages) % self.stages_per_rank:
            raise PlanError(
                f"{len(self.stages)} stages do not divide into {self.stages_per_rank} per rank"
            )
        fixed = self.schedule.fixed_stages_per_rank
        if fixed is not None and self.stages_per_rank != fixed:
            raise PlanError(
                f"schedule {self.schedule.value} runs {fixed} stages per rank, the plan has "
                f"{self.stages_per_rank}; re-plan with schedule={self.schedule.value!r}"
            )
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise PlanError(
                f"batch size {self.batch_size} does not split into {self.microbatches} microbatches"
            )
        if self.data_parallel is not None and not self.data_parallel.is_resolved:
            raise PlanError(
                f"the plan's data_parallel must name its engine and replicas, got "
                f"{self.data_parallel}; plan with data_parallel='auto' or "
                f"DataParallelOptions(kind='ddp' or 'fsdp', replicas=D)"
            )
        self._index.update({n.name: i for i, n in enumerate(self.nodes)})
        if len(self._index) != len(self.nodes):
            raise PlanError("duplicate node names in the cost table")
        for s in self.stages:
            for name in s.nodes:
                if name not in self._index:
                    raise PlanError(f"stage {s.index} lists node {name!r}, not in the cost table")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        """Ranks of the pipeline: stages / stages per rank."""
        return len(self.stages) // self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs ``stage`` (the schedule's placement)."""
        return rank_of(stage, self.num_ranks, self.schedule.placement)

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``rank`` runs, in increasing order."""
        return stages_on(rank, self.num_ranks, self.num_stages, self.schedule.placement)

    def node(self, name: str) -> NodeCost:
        return self.nodes[self._index[name]]

    @property
    def memory_headroom_bytes(self) -> int | None:
        """A cluster plan's room left on its fullest GPU: the device's memory less the run's
        predicted peak (negative: it does not fit, which the planner only returns for a run it
        was told to price as asked); None for a plan without a cluster."""
        if self.cluster is None or self.run is None:
            return None
        return self.cluster.memory_bytes - self.run.peak_memory_bytes

    def runs_like(self, other: Plan) -> bool:
        """True if ``other`` runs exactly as this plan does: the same nodes, parameters and
        recompute on every stage, the same schedule, microbatches and layout; only costs and
        predictions may differ. A pipeline built for one then serves the other."""
        def layout(p: Plan) -> tuple[Any, ...]:
            return (p.fingerprint, p.schedule, p.microbatches, p.batch_size, p.stages_per_rank,
                    p.data_parallel, p.tied, p.inputs, p.chunked,
                    tuple((s.nodes, s.parameters, s.recompute, s.recomputed, s.inputs, s.outputs) for s in p.stages))
        return layout(self) == layout(other)

    def noted(self, note: str) -> Plan:
        """This plan with ``note`` appended to its solver's notes (the summary and the report
        print them); the same plan where ``note`` is empty."""
        if not note:
            return self
        detail = f"{self.solver.detail}; {note}" if self.solver.detail else note
        return replace(self, solver=replace(self.solver, detail=detail))

    def stage_of(self) -> dict[str, int]:
        """Map every partitioned node name to its stage index."""
        return {name: s.index for s in self.stages for name in s.nodes}

    # --- JSON (pydantic, see pipecut.schema) ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        from pipecut.schema import plan_data  # the schema module imports this one

        return plan_data(self)

    def to_json(self, path: str | Path | None = None) -> str:
        from pipecut.schema import dump_plan

        text = dump_plan(self)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Build a plan from parsed JSON data; errors name the bad field's JSON path."""
        from pipecut.schema import validate_plan_dict

        return validate_plan_dict(data)

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> Plan:
        """Load a plan from a file path or a JSON string; errors name the bad field's path."""
        from pipecut.schema import load_plan

        text = str(path_or_text)
        if isinstance(path_or_text, Path) or not text.lstrip().startswith("{"):
            try:
                text = Path(path_or_text).read_text()
            except OSError as e:
                raise PlanError(f"cannot read plan {path_or_text}: {e}") from e
        return load_plan(text)
