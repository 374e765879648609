"""A cluster as plan data: nodes × GPUs per node of one device, and the two links between GPUs.

Sits with the plan data (the plan records the cluster it was made for and where each stage of
each replica runs), below the passes that price it (:mod:`pipecut.planning.cluster.run`). Parsing
``"8x8xH100-SXM"`` needs the device profiles and lives in :mod:`pipecut.planning.cluster.plan`.

GPU ``g`` sits on node ``g // gpus_per_node``. Two GPUs of one node talk over ``intra`` (NVLink);
GPUs of different nodes over ``inter`` (InfiniBand or RoCE: the bandwidth of one GPU's own
network port, per direction). A ring collective whose members span nodes runs at ``inter``: a
ring is as fast as its slowest hop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pipecut.core.kinds import FrameworkKind
from pipecut.errors import InputError

__all__ = ["Cluster", "ClusterPlacement", "Layout", "Link", "MemoryPart", "RunPrediction", "StepPart"]


LINK_LATENCY_MS = 0.01
"""Per-message latency of a link known only by its bandwidth (a device profile's interconnect)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """A link between two GPUs (neighbouring stages, or the members of a ring): bandwidth per
    direction and latency per message. ``name`` says which kind of link it is where that is
    known ("NVLink 4", "network 400 Gb/s per GPU"); ``measured`` whether it was timed here."""

    bandwidth_bytes_per_ms: float
    latency_ms: float = 0.0
    measured: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_ms > 0 or not self.latency_ms >= 0:
            raise InputError(
                f"link {self.name or '(unnamed)'}: bandwidth must be positive and latency "
                f"non-negative, got {self.bandwidth_bytes_per_ms} bytes/ms and {self.latency_ms} ms"
            )

    def transfer_ms(self, nbytes: int, messages: int = 1) -> float:
        """``nbytes`` sent as ``messages`` tensors, each paying the latency once."""
        return 0.0 if nbytes == 0 else self.latency_ms * max(1, messages) + nbytes / self.bandwidth_bytes_per_ms


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    device: str
    """Name of the device profile every GPU has (``pipecut.profile.devices.device_profile``)."""
    memory_bytes: int
    """Memory of one GPU (from the profile)."""
    peak_flops: float
    """Dense bf16 peak FLOP/s of one GPU, from its datasheet: the denominator of MFU."""
    intra: Link
    """Between GPUs of one node."""
    inter: Link
    """Between GPUs of different nodes (one GPU's network port)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise InputError(
                f"a cluster needs at least 1 node of at least 1 GPU, got {self.nodes} node(s) of "
                f"{self.gpus_per_node}"
            )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def spec(self) -> str:
        """``"8x8xH100-SXM"``: what :func:`pipecut.planning.cluster.figures.parse_cluster` reads back."""
        return f"{self.nodes}x{self.gpus_per_node}x{self.device}"

    def node_of(self, gpu: int) -> int:
        if not 0 <= gpu < self.gpus:
            raise InputError(f"GPU {gpu} is not in {self.spec} (GPUs 0..{self.gpus - 1})")
        return gpu // self.gpus_per_node

    def link_between(self, a: int, b: int) -> Link:
        """The link a message from GPU ``a`` to GPU ``b`` crosses."""
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    def ring_link(self, gpus: tuple[int, ...]) -> Link:
        """The link bounding a ring collective over ``gpus``: inter-node if they span nodes."""
        return self.intra if len({self.node_of(g) for g in gpus}) <= 1 else self.inter


class Layout(enum.Enum):
    """How D replicas × K stages are laid onto the cluster's GPUs (numbered node by node), each
    (replica, stage) on one tensor-parallel group of T consecutive GPUs of one node (T = 1: one
    GPU); the positions below count groups."""

    STAGES_INSIDE_NODES = "stages_inside_nodes"
    """Replica r's stage s on group r·K + s: a pipeline's cuts stay on NVLink where T·K fits a
    node; each stage's replica group spans nodes."""
    REPLICAS_INSIDE_NODES = "replicas_inside_nodes"
    """Stage s of replica r on group s·D + r: a stage's replica ring stays on NVLink where T·D
    fits a node; the pipeline's cuts cross nodes."""

    def gpu(self, replica: int, stage: int, replicas: int, stages: int) -> int:
        if self is Layout.STAGES_INSIDE_NODES:
            return replica * stages + stage
        return stage * replicas + replica


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterPlacement:
    """Which GPUs hold which stage of which replica (chosen by predicted step): D replicas ×
    K pipeline ranks, each on a tensor-parallel group of T consecutive GPUs of one node."""

    layout: Layout
    replicas: int
    stages: int
    tensor_parallel: int = 1
    """T: the GPUs of one node that split each stage's layers between them (1: none)."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.stages < 1 or self.tensor_parallel < 1:
            raise InputError(f"a placement needs replicas and stages ≥ 1 and tensor parallelism ≥ 1, got "
                             f"{self.replicas} × {self.stages} × {self.tensor_parallel}")

    @property
    def gpus(self) -> int:
        """D · K · T."""
        return self.replicas * self.stages * self.tensor_parallel

    def gpu(self, replica: int, stage: int) -> int:
        """The first GPU of the group holding ``stage`` of ``replica``."""
        return self.tensor_parallel * self.layout.gpu(replica, stage, self.replicas, self.stages)

    def tensor_group(self, replica: int, stage: int) -> tuple[int, ...]:
        """The T GPUs that hold ``stage`` of ``replica`` between them (its tensor-parallel group)."""
        first = self.gpu(replica, stage)
        return tuple(range(first, first + self.tensor_parallel))

    def grid(self) -> tuple[tuple[int, int], ...]:
        """Per GPU, in order: (replica, stage) it holds (its share, with T > 1)."""
        out: dict[int, tuple[int, int]] = {}
        for r in range(self.replicas):
            for s in range(self.stages):
                for g in self.tensor_group(r, s):
                    out[g] = (r, s)
        return tuple(out[g] for g in sorted(out))

    def tensor_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every tensor-parallel group, in GPU order."""
        return tuple(sorted(self.tensor_group(r, s) for r in range(self.replicas) for s in range(self.stages)))

    def replica_group(self, stage: int) -> tuple[int, ...]:
        """The GPUs holding ``stage`` of every replica at the first position of their tensor
        group (its FSDP/DDP ring; the rings of the other positions cross the same links)."""
        return tuple(self.gpu(r, stage) for r in range(self.replicas))


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPart:
    """One part of a predicted step on the GPU that ends it last: ``compute``, ``recompute``,
    ``bubble`` (idle, waiting on other stages) or ``link <name>`` (collectives and cut transfers on
    that link that no compute hides). A step's parts add up to it."""

    name: str
    ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPart:
    """One term of the peak GPU's predicted memory: what it is and its bytes."""

    name: str
    nbytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPrediction:
    """What a training step on the cluster is predicted to achieve (one optimizer step)."""

    step_ms: float
    bubble_fraction: float
    """Share of the GPUs' step spent idle in the pipeline (0 for K = 1)."""
    tokens_per_s_per_gpu: float
    """Tokens (samples × sequence length) of the global batch per second, divided by the GPUs."""
    mfu: float
    """Model FLOP/s achieved (6·params·tokens + attention, per second per GPU) / ``peak_flops``."""
    peak_memory_bytes: int
    """Largest predicted memory of one GPU: the terms of ``memory_parts`` (in plans written before
    them, tensors only)."""
    compute_ms: float = 0.0
    """Busy compute of the slowest GPU in the step (recompute included)."""
    exposed_comm_ms: float = 0.0
    """FSDP/DDP collectives not hidden behind compute, on the slowest stage."""
    recompute: str = "none"
    """Activation checkpointing assumed: none, selective or full."""
    sharding: str = "fsdp"
    """fsdp (parameters, gradients, optimizer state sharded over replicas) or ddp."""
    sequence_parallel: bool = False
    """With tensor parallelism: the residual stream split along the sequence as well."""
    compute_efficiency: float = 0.0
    """Fraction of peak FLOP/s a matrix product reaches in a run of :attr:`framework`'s kernels on
    the device family (fitted once per kernels and family)."""
    framework: FrameworkKind = FrameworkKind.PIPECUT
    """The framework whose run this prices (``compiler/frameworks.json``): its kernels, what its runtime
    holds. A plan written before frameworks were named reads as pipecut's own."""
    notes: tuple[str, ...] = ()
    """What the model assumes or cannot express (tensor parallelism, ...)."""
    step_low_ms: float = 0.0
    step_high_ms: float = 0.0
    """The same run (split, layout, schedule) priced with every hardware figure at the fast and at
    the slow end of its sources' spread (the fitted residual kept): the prediction's range. 0 where
    unknown (a family without hardware figures, or a plan written before ranges)."""
    parts: tuple[StepPart, ...] = ()
    """The step taken apart on the GPU that ends it last (see :class:`StepPart`), largest first."""
    memory_parts: tuple[MemoryPart, ...] = ()
    """What ``peak_memory_bytes`` counts on that GPU, term by term: its data-parallel kind's
    parameters, gradients and optimizer state, the activations its schedule keeps, the CUDA
    context and NCCL's buffers, the caching allocator's reserve. A term not listed is not counted."""

    @property
    def dominant(self) -> str:
        """The assumption the step depends on most: the name of its largest part ("" if none)."""
        return max(self.parts, key=lambda p: p.ms).name if self.parts else ""

    @property
    def has_range(self) -> bool:
        return 0 < self.step_low_ms <= self.step_ms <= self.step_high_ms
