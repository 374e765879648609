"""Plans for the report tests: synthetic cost tables (fast, any size) and a real example model."""

from __future__ import annotations

from pipecut import DeviceSpec, Plan
from pipecut.core.kinds import LeafKind, NodeOp
from pipecut.ir import Leaf, NodeCost
from pipecut.passes.partition.solve import partition_costs

TENSOR_SPEC = '[1, {"type": null, "context": null, "children_spec": []}]'
"""The serialized pytree spec of a single tensor (``treespec_dumps`` of a leaf)."""


def synthetic_nodes(layers: int, per_layer: int = 10, width: int = 64, micro: int = 2) -> list[NodeCost]:
    """``x -> layers.i.op_j ... -> head -> output`` with module paths, a residual per layer."""
    shape = (micro, width)
    nbytes = micro * width * 4
    leaf = (Leaf(kind=LeafKind.TENSOR, shape=shape, dtype="float32", requires_grad=True),)

    def node(name: str, op: NodeOp, module: str, inputs: tuple[str, ...], ms: float = 0.0,
             params: tuple[str, ...] = ()) -> NodeCost:
        return NodeCost(
            name=name, op=op, target=name.split("_")[0], module=module, inputs=inputs,
            forward_ms=ms, backward_ms=2 * ms, output_bytes=nbytes, shape=shape, dtype="float32",
            leaves=leaf, treespec=TENSOR_SPEC, parameters=params,
            param_bytes=width * width * 4 if params else 0,
        )

    nodes = [node("x", NodeOp.PLACEHOLDER, "", ())]
    prev = "x"
    for i in range(layers):
        start = prev
        for j in range(per_layer):
            name = f"linear_{i}_{j}" if j % 2 == 0 else f"gelu_{i}_{j}"
            params = (f"layers.{i}.fc{j}.weight",) if j % 2 == 0 else ()
            module = f"layers.{i}.fc{j}" if j % 2 == 0 else f"layers.{i}"
            nodes.append(node(name, NodeOp.CALL_MODULE if params else NodeOp.CALL_FUNCTION,
                              module, (prev,), 0.1 + 0.01 * j, params))
            prev = name
        nodes.append(node(f"add_{i}", NodeOp.CALL_FUNCTION, f"layers.{i}", (prev, start), 0.01))
        prev = f"add_{i}"
    nodes.append(node("head", NodeOp.CALL_MODULE, "head", (prev,), 0.2, ("head.weight",)))
    nodes.append(node("output", NodeOp.OUTPUT, "", ("head",)))
    return nodes


def synthetic_plan(layers: int = 6, stages: int = 3, microbatches: int = 4,
                   memory_bytes: int | None = None, schedule: str = "1f1b",
                   per_layer: int = 10) -> Plan:
    nodes = synthetic_nodes(layers, per_layer)
    return partition_costs(
        nodes,
        devices=[DeviceSpec(name="cpu", memory_bytes=memory_bytes)] * stages,
        microbatches=microbatches,
        batch_size=2 * microbatches,
        schedule=schedule,
        fingerprint=f"synthetic-{layers}x{per_layer}",
        inputs=("x",),
    )


def example_plan(stages: int = 3, microbatches: int = 4) -> Plan:
    """The shipped GPT example (small), really captured and profiled."""
    from examples.gpt import build

    model, inputs, loss_fn, target = build(batch_size=8, layers=3, seq=32, dim=64)
    import pipecut

    return pipecut.plan(model, inputs, stages, loss_fn=loss_fn, target=target,
                        microbatches=microbatches, schedule="1f1b")
