"""The kinds plan data names: fx opcodes, capture methods, schedules, recompute, cost sources.

Enums, not strings: the plan, the options (:mod:`pipecut.options`) and the passes share them,
and this module is their one home: import them from here (or from :mod:`pipecut`, the public
surface), not through :mod:`pipecut.ir`.
"""

from __future__ import annotations

import enum

from pipecut.schedules.format import Placement

__all__ = [
    "AttentionKernel",
    "CaptureMethod",
    "CostSource",
    "DataParallelKind",
    "Fp8Recipe",
    "FrameworkKind",
    "KernelKind",
    "KernelsKind",
    "LeafKind",
    "NodeOp",
    "Partitioner",
    "Recompute",
    "ScheduleKind",
    "TensorShard",
]


class NodeOp(enum.Enum):
    """The six torch.fx opcodes."""

    PLACEHOLDER = "placeholder"
    GET_ATTR = "get_attr"
    CALL_FUNCTION = "call_function"
    CALL_METHOD = "call_method"
    CALL_MODULE = "call_module"
    OUTPUT = "output"


class CaptureMethod(enum.Enum):
    SYMBOLIC_TRACE = "symbolic_trace"
    EXPORT = "export"


class ScheduleKind(enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZERO_BUBBLE = "zero-bubble"
    ZBV = "zbv"
    """Zero-bubble V: two stages per rank laid as a V (rank r runs stages r and 2K - 1 - r),
    backward split into I and W."""

    @property
    def placement(self) -> Placement:
        """How the schedule lays its stages on the ranks (see :func:`pipecut.schedules.format.rank_of`)."""
        return Placement.V if self is ScheduleKind.ZBV else Placement.LOOP

    @property
    def splits_backward(self) -> bool:
        """Runs each backward as an input-gradient part I and a weight part W."""
        return self in (ScheduleKind.ZERO_BUBBLE, ScheduleKind.ZBV)

    @property
    def fixed_stages_per_rank(self) -> int | None:
        """The stages per rank the schedule always runs (ZBV: 2), or None where it is chosen."""
        return 2 if self is ScheduleKind.ZBV else None


class Recompute(enum.Enum):
    NONE = "none"
    FULL = "full"
    """The whole stage's forward runs again in backward: only the stage's inputs are kept."""
    SELECTIVE = "selective"
    """Some blocks of the stage (``Stage.recomputed``) run again in backward; the rest keep
    their activations: memory traded for time in steps finer than a whole stage."""


class LeafKind(enum.Enum):
    TENSOR = "tensor"
    CONSTANT = "constant"


class CostSource(enum.Enum):
    """Where a node's times came from."""

    MEASURED = "measured"
    """Timed by running the node (``pipecut.profile.nodes``)."""
    ESTIMATED = "estimated"
    """Roofline estimate from FLOP and byte counts and a device profile (``pipecut.profile.devices``)."""


class Partitioner(enum.Enum):
    DP = "dp"
    ILP = "ilp"
    GIVEN = "given"


class DataParallelKind(enum.Enum):
    """The engine that replicates every stage across pipeline replicas."""

    DDP = "ddp"
    """DistributedDataParallel on each stage: every replica holds all of its stage's state."""
    ZERO1 = "zero1"
    """ZeRO-1: the optimizer state sharded over the replicas (torch's ``ZeroRedundancyOptimizer``),
    parameters and gradients whole; gradients all-reduced by DDP as under :attr:`DDP`, and each
    replica's updated parameters broadcast after the optimizer step."""
    FSDP = "fsdp"
    """FSDP2 ``fully_shard`` on each stage: parameters, gradients and optimizer state sharded."""


class KernelKind(enum.Enum):
    """How the per-op cost model prices a node (:func:`pipecut.profile.hardware.kernel_kind`)."""

    GEMM = "gemm"
    """A matrix product (linear, matmul, bmm, conv): FLOPs at its shape's efficiency."""
    ATTENTION = "attention"
    """A fused attention kernel (SDPA): FLOPs at the kernel's own efficiency."""
    MEMORY = "memory"
    """Elementwise, norms, softmax, lookups, the loss: bytes at HBM speed."""


class AttentionKernel(enum.Enum):
    """The fused attention kernel a run uses (eager attention is separate nodes)."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    """xFormers' memory-efficient kernel (PyTorch's ``_efficient_attention``)."""


class FrameworkKind(enum.Enum):
    """Whose training runtime a cluster prediction prices (``compiler/frameworks.json``): the
    kernels it runs and what it holds beyond pipecut's own runtime."""

    PIPECUT = "pipecut"
    """pipecut's own runtime: eager ATen kernels, torch's DDP / ZeroRedundancyOptimizer / FSDP2."""
    TORCHTITAN = "torchtitan"
    """torchtitan in eager mode, bf16, its pipeline on torch.distributed.pipelining."""
    TORCHTITAN_COMPILE_FLOAT8 = "torchtitan-compile-float8"
    """torchtitan with torch.compile and Float8 linears (torchao)."""
    LLM_FOUNDRY = "llm-foundry"
    """MosaicML's LLM Foundry on Composer: FSDP, eager kernels."""
    MEGATRON = "megatron"
    """Megatron-LM and Megatron-Core (and code built on it, as the Zero Bubble paper's): fused
    kernels, its own pipeline and distributed optimizer."""
    MEGATRON_DEEPSPEED = "megatron-deepspeed"
    """BigScience's Megatron-DeepSpeed (BLOOM's): Megatron-LM's fused kernels and tensor
    parallelism, DeepSpeed's pipeline engine and ZeRO-1."""


class Fp8Recipe(enum.Enum):
    """How an FP8 product's scale is found (Transformer Engine's recipes): what it costs beyond
    the product is one read of each cast tensor (delayed) or two (current)."""

    DELAYED = "delayed"
    """The scale from the amax history of earlier steps: one read per cast."""
    CURRENT = "current"
    """The scale from this tensor's own amax: one read to find it, one to cast."""


class KernelsKind(enum.Enum):
    """The kernels a framework's products run on: one in-run fraction of dense peak per device
    family, shared by every framework that runs the same kernels."""

    EAGER = "eager"
    """torch's eager ATen kernels (cuBLAS products, SDPA), no fusion across ops."""
    COMPILED_FLOAT8 = "compiled-float8"
    """Inductor-compiled graphs with Float8 linears (priced against the bf16 peak)."""
    MEGATRON = "megatron"
    """Megatron's fused kernels (fused norms, bias-activation, softmax; Transformer Engine on Hopper)."""


class TensorShard(enum.Enum):
    """How a node of the cost table runs under tensor parallelism (Megatron's pairing: a
    column-wise product opens a sharded region, a row-wise one closes it with a reduction).
    :func:`pipecut.passes.parallel.tensor.shard_kinds` gives each node its kind."""

    REPLICATED = "replicated"
    """Every rank of the group computes it whole (norms, residual adds; split by sequence
    under sequence parallelism)."""
    COLUMN = "column"
    """A product whose weight is split by output features (q/k/v, gate/up, the LM head): its
    output is sharded."""
    ROW = "row"
    """A product whose weight is split by input features (o, down): partial sums, reduced
    across the group (all-reduce, or reduce-scatter with sequence parallelism)."""
    SPLIT = "split"
    """Work on sharded values between a column and a row product (attention heads, the MLP's
    hidden features, a vocabulary-parallel loss): each rank does its share."""
    VOCAB = "vocab"
    """An embedding lookup on a shard of the vocabulary, reduced across the group."""
