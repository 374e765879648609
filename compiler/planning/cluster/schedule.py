"""A cluster run's pipeline as its schedule runs it: virtual stages, the weight pass, live memory.

The training-run model (:mod:`pipecut.planning.cluster.run`) prices every schedule with the
generators and the simulator that the runtime's plans use (:func:`pipecut.schedules.standard.build`,
:func:`pipecut.schedules.simulate.rank_end_ms`), so a schedule has one model for both. This module
holds the three things the run model needs around them, each read off the schedule, not a formula:

* **Virtual stages** (:func:`chunk_options`). Interleaved 1F1B cuts the model into V·K stages,
  stage s on rank s mod K, so a microbatch crosses V·K − 1 cuts instead of K − 1; ZBV always
  cuts 2K stages on a V (rank r runs stages r and 2K − 1 − r, whose turn on rank K − 1 sends
  nothing). The run model weighs V = 2, and every larger V that divides the transformer blocks
  evenly over the V·K stages.
* **The weight pass** (:func:`weight_ms`). Zero-bubble and ZBV run each backward as an input
  pass I and a weight pass W. The cost table has no split of its own, so the plan's rule is used
  (:func:`pipecut.passes.costs.stages.build_stages` prices ``Stage.weight_ms`` the same way): a
  product's weight gradient costs as much as its input gradient, so W is half the backward of
  the units that read parameters; a stage no gradient leaves (the first: its inputs are data)
  has no input gradient to hand on, so W is its whole backward.
* **Live activations** (:func:`peak_activations`). Each rank's actions are walked in order: a
  forward keeps its microbatch's activations, a whole backward frees them; with a split
  backward they live until the W pass, and a recomputed block's activations, rebuilt in the I
  pass, stay until W too (the weight gradient reads them). The in-flight microbatches are
  therefore what the schedule keeps (1F1B: K − s; GPipe: M; interleaved: its warm-up), and the
  peak of a rank with several stages is that of its stages together at one moment.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipecut.core.kinds import ScheduleKind
from pipecut.passes.costs.workload import Workload
from pipecut.schedules.format import ActionKind, Schedule

__all__ = ["chunk_options", "peak_activations", "weight_ms"]


def chunk_options(kind: ScheduleKind, ranks: int, blocks: int) -> tuple[int, ...]:
    """The stages per rank V to weigh for ``kind`` on ``ranks`` pipeline ranks and a model of
    ``blocks`` transformer blocks: interleaved 1F1B 2 and every V > 2 with ``blocks`` a multiple
    of V·K; ZBV its fixed 2; the other schedules 1.

    >>> chunk_options(ScheduleKind.INTERLEAVED_1F1B, 4, 32), chunk_options(ScheduleKind.ZBV, 4, 32)
    ((2, 4, 8), (2,))
    """
    fixed = kind.fixed_stages_per_rank
    if fixed is not None:
        return (fixed,)
    if kind is not ScheduleKind.INTERLEAVED_1F1B:
        return (1,)
    more = [v for v in range(3, blocks // max(ranks, 1) + 1) if blocks % (v * ranks) == 0]
    return (2, *more)


def weight_ms(work: Workload, start: int, end: int, replicas: int) -> float:
    """The W pass of the stage of units ``[start, end)`` at one of ``replicas`` replicas' share
    (see the module docstring for the rule)."""
    backward = work.backward_ms[start:end]
    leaves = work.cut_backward_bytes[start] > 0 if work.cut_backward_bytes else start > 0
    if not leaves:
        return sum(backward) / replicas
    return sum(b for b, p in zip(backward, work.param_bytes[start:end]) if p) / (2 * replicas)


def peak_activations(
    schedule: Schedule, kept: Sequence[float], retained: Sequence[float], transient: Sequence[float],
    held: Sequence[float] = (), left: Sequence[float] = (),
) -> tuple[float, ...]:
    """Per stage, its activation bytes at the moment its rank's activations peak.

    ``kept[s]``: bytes a microbatch keeps on stage s from its forward to its backward (or to its
    W pass); ``retained[s]``: what a split backward's I pass rebuilds by recomputation and keeps
    until W; ``transient[s]``: one recomputed block's activations while it is rebuilt in the
    backward; ``held[s]`` (default none): bytes each forward on stage s adds that no action
    frees before the step ends (a published run's runtime keeping its outputs); ``left[s]``
    (default none): likewise, added by each backward (its I pass where split) once it is done
    (the input gradients a published run's runtime leaves on its buffers). The stages of one
    rank sum to that rank's peak.
    """
    shares = [0.0] * len(kept)
    for actions in schedule:
        live: dict[int, float] = {}
        best, at = -1.0, dict(live)
        for a in actions:
            s = a.stage
            live.setdefault(s, 0.0)
            bump = 0.0
            if a.kind is ActionKind.FORWARD:
                live[s] += kept[s] + (held[s] if held else 0.0)
            elif a.kind is ActionKind.BACKWARD:
                bump = transient[s]
            elif a.kind is ActionKind.INPUT:
                bump = max(transient[s], retained[s])
            during = sum(live.values()) + bump
            if during > best:
                best, at = during, dict(live)
                at[s] += bump
            if a.kind is ActionKind.BACKWARD:
                live[s] -= kept[s] - (left[s] if left else 0.0)
            elif a.kind is ActionKind.INPUT:
                live[s] += retained[s] + (left[s] if left else 0.0)
            elif a.kind is ActionKind.WEIGHT:
                live[s] -= kept[s] + retained[s]
        for s, nbytes in at.items():
            shares[s] = max(0.0, nbytes)
    return tuple(shares)
