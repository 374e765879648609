"""Context parallelism, priced: each of CP GPUs holds 1/CP of every sequence and passes the keys
and values round a ring, as Megatron-Core runs it (``docs/user-guide/features/context_parallel.md``).

A CP rank is priced as a data-parallel replica that holds ``seq / CP`` tokens of each sample
(its parameters are whole, its gradients reduced with the data-parallel ones over D × CP), with
two differences this module adds to its priced cost table:

* **attention reads every key**: a rank's queries attend to the whole sequence, so its attention
  FLOPs are those of ``seq / CP`` queries against ``seq`` keys (the cost table is built with the
  full key length, :func:`attention_flops_scale` says by how much a local table is short);
* **the ring**: forward, each rank receives the other CP − 1 ranks' key and value chunks, one
  step at a time, each transfer overlapped with the attention of the chunk before; backward
  gathers them again (each rank keeps only its own chunk) and sends the key and value gradients
  back: twice the bytes (:func:`ring_exposed_ms`). Only what a step's compute does not cover is
  added to the attention's time.

Memory is the local table's: activations of ``seq / CP`` tokens, the rank's own key and value
chunk kept. Load balancing of causal attention (2 × CP chunks, Megatron's and Llama 3's) is taken
as perfect: every rank does half of its query-key pairs. Not priced: Llama 3's all-gather variant
(the same bytes, exposed once rather than step by step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pipecut.cluster import Link
from pipecut.core.kinds import KernelKind
from pipecut.ir import NodeCost
from pipecut.profile.flops import NodeWork
from pipecut.profile.hardware import kernel_kind

__all__ = ["BACKWARD_RING_BYTES", "attention_flops_scale", "ring_exposed_ms", "with_context_parallel"]

BACKWARD_RING_BYTES = 2
"""Backward moves twice the forward's ring bytes: the key and value chunks gathered again and
their gradients sent back (Megatron-Core's context-parallel guide: 'each GPU stores only the KV
of a sequence chunk in forward and gathers KV again in backward')."""


def attention_flops_scale(cp: int) -> int:
    """How many times a cost table built at ``seq / CP`` tokens under-counts a rank's attention
    FLOPs: its queries attend to all CP chunks of keys, not to its own only."""
    return cp


def ring_exposed_ms(attention_ms: float, chunk_bytes: float, cp: int, link: Link) -> float:
    """The ring's exposed time for one attention: CP − 1 steps, each moving ``chunk_bytes`` over
    ``link`` while the attention of one chunk (``attention_ms / CP``) runs."""
    if cp <= 1:
        return 0.0
    step = link.latency_ms + chunk_bytes / link.bandwidth_bytes_per_ms
    return (cp - 1) * max(0.0, step - attention_ms / cp)


def with_context_parallel(nodes: Sequence[NodeCost], work: Mapping[str, NodeWork], cp: int, link: Link,
                          kv_chunk_bytes: Mapping[str, float], *, replicas: int = 1) -> tuple[NodeCost, ...]:
    """``nodes`` (priced at a rank's ``seq / CP`` tokens, attention at the full key length) with
    each attention row's ring added. The table holds one microbatch of all ``replicas`` (D × CP
    ranks, each its share): the ring is priced on one rank's share of the attention and of the
    bytes (``kv_chunk_bytes``: an attention row → one rank's key and value chunk), and added to the
    table times ``replicas``. Rows that are not attention are returned as they are."""
    if cp <= 1:
        return tuple(nodes)
    out = []
    for row in nodes:
        w = work.get(row.name, NodeWork())
        if kernel_kind(str(row.target), w.forward_flops) is not KernelKind.ATTENTION or row.name not in kv_chunk_bytes:
            out.append(row)
            continue
        chunk = kv_chunk_bytes[row.name]
        fwd = ring_exposed_ms(row.forward_ms / replicas, chunk, cp, link) * replicas
        bwd = ring_exposed_ms(row.backward_ms / replicas, BACKWARD_RING_BYTES * chunk, cp, link) * replicas
        out.append(dataclasses.replace(row, forward_ms=row.forward_ms + fwd, backward_ms=row.backward_ms + bwd))
    return tuple(out)
