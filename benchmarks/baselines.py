"""How other tools split a model, re-implemented from their descriptions, for the benchmark.

All of them split a sequence of *layers* (the children of an ``nn.Sequential``), so a layer here
is a run of units under one layer-level module (see :func:`layer_starts`). Each function returns
the unit indices where stages start; :func:`pipecut.passes.partition.problem.evaluate` then scores the split
with the same cost model as pipecut's own, communication included.

- :func:`equal_layers`: the same number of layers per stage (DeepSpeed ``partition_method=
  "uniform"``, or hand-picked split points every L/K layers as in torch.distributed.pipelining).
- :func:`balanced` over parameter counts: DeepSpeed's default ``partition_method="parameters"``,
  which splits the layers so that each stage's parameter count is as equal as possible.
- :func:`block_partition` over measured times: torchgpipe's ``balance_by_time``, which times every
  layer and splits with the heuristic of Bárány and Grinberg, "Block partitions of sequences"
  (Israel J. Math., 2015): repeatedly move one element from the heaviest block towards the
  lightest one while that lowers the heaviest block.
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Sequence

import numpy as np

__all__ = [
    "Baseline",
    "balanced",
    "baseline_bounds",
    "block_partition",
    "equal_layers",
    "layer_key",
    "layer_starts",
    "layer_sums",
]

_INDEX = re.compile(r"^\d+$")


def layer_key(module: str) -> str:
    """The layer a module path belongs to: up to its first numeric part (``h.3`` of ``h.3.attn``)."""
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


def layer_starts(modules: Sequence[str]) -> list[int]:
    """Unit indices where a new layer starts; units of the top-level ``forward`` join the layer before."""
    starts, current = [0], None
    for u, m in enumerate(modules):
        key = layer_key(m)
        if not key:
            continue
        if current is not None and key != current:
            starts.append(u)
        current = key
    return starts


def _to_units(layer_bounds: Sequence[int], starts: Sequence[int], n: int) -> tuple[int, ...]:
    return tuple(starts[b] if b < len(starts) else n for b in layer_bounds)


def equal_layers(layers: int, k: int) -> list[int]:
    """Layer bounds giving every stage ``layers // k`` or one more layer."""
    return [round(s * layers / k) for s in range(k + 1)]


def balanced(weights: Sequence[float], k: int) -> list[int]:
    """Layer bounds minimising the largest stage sum of ``weights`` (contiguous, exact).

    Binary search on the bound with a greedy check, over the distinct prefix-sum differences.
    """
    n = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=np.float64))])

    def greedy(bound: float) -> list[int] | None:
        bounds, i = [0], 0
        for s in range(k):
            if s == k - 1:
                j = n
            else:
                fit = int(np.searchsorted(prefix, prefix[i] + bound * (1 + 1e-12), side="right"))
                j = min(fit - 1, n - (k - s - 1))
            if j <= i or prefix[j] - prefix[i] > bound * (1 + 1e-12):
                return None
            bounds.append(j)
            i = j
        return bounds

    lo, hi = max(weights, default=0.0), float(prefix[-1])
    best = greedy(hi) or equal_layers(n, k)
    for _ in range(100):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        found = greedy(mid)
        if found is None:
            lo = mid
        else:
            best, hi = found, mid
    return best


def block_partition(weights: Sequence[float], k: int) -> list[int]:
    """Bárány–Grinberg block partition: move elements from the heaviest block to the lightest."""
    n = len(weights)
    scale = max(weights, default=0.0) or 1.0
    w = [x / scale for x in weights]  # the paper's elements lie in [0, 1]
    bounds = equal_layers(n, k)

    def sums(b: Sequence[int]) -> list[float]:
        return [sum(w[b[s] : b[s + 1]]) for s in range(k)]

    for _ in range(10 * n * k):
        blocks = sums(bounds)
        top = max(range(k), key=lambda s: blocks[s])
        low = min(blocks)
        if blocks[top] <= low + 1:  # the paper's stopping rule: max ≤ min + largest element
            break
        # the lightest block nearest the heaviest one, and the step towards it
        q = min((s for s in range(k) if blocks[s] == low), key=lambda s: abs(s - top))
        step = -1 if q > top else 1  # boundaries move away from the lighter block's side
        trial = list(bounds)
        # shift every boundary between the two blocks by one element towards the lighter block
        for s in range(top + 1, q + 1) if q > top else range(q + 1, top + 1):
            trial[s] += step
        if any(a >= b for a, b in itertools.pairwise(trial)):
            break
        if max(sums(trial)) >= blocks[top]:
            break
        bounds = trial
    return bounds


class Baseline(enum.Enum):
    LAYERS = "equal layers"
    PARAMS = "equal params"
    TIME = "block partition of times"


def baseline_bounds(
    modules: Sequence[str],
    layer_weights: Sequence[float],
    k: int,
    method: Baseline,
) -> tuple[int, ...] | None:
    """Unit bounds of a baseline split, or None when there are fewer layers than stages."""
    starts = layer_starts(modules)
    layers = len(starts)
    if layers < k:
        return None
    if method is Baseline.LAYERS:
        lb = equal_layers(layers, k)
    elif method is Baseline.PARAMS:
        lb = balanced(layer_weights, k)
    else:
        lb = block_partition(layer_weights, k)
    return _to_units(lb, starts, len(modules))


def layer_sums(modules: Sequence[str], per_unit: Sequence[float]) -> list[float]:
    """Sum a per-unit quantity over the layers of :func:`layer_starts`."""
    starts = [*layer_starts(modules), len(modules)]
    return [float(sum(per_unit[a:b])) for a, b in itertools.pairwise(starts)]
