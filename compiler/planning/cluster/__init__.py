"""The cluster planner: a real-size training run planned for a cluster that is not here.

Read top to bottom; each module hands data down and none calls back up:

1. :mod:`~pipecut.planning.cluster.plan` — :func:`plan_cluster`, the flow: price the table →
   shard by T → evaluate runs → choose → make the plan.
2. :mod:`~pipecut.planning.cluster.figures` — the hardware and its links: the cluster text read,
   and the cluster with its device's per-op model resolved once into :class:`Figures` at one end
   of the figures' range; everything below takes that record.
3. :mod:`~pipecut.planning.cluster.tables` — the cost table: captured and priced for the device
   (at the figures' values and again at either end), and at one GPU's share of a T-way tensor
   group.
4. :mod:`~pipecut.planning.cluster.choose` — every D × T × K × layout × schedule evaluated under
   each engine of the replicas, the fastest that fits kept (or the refusal, with what would fit),
   and the chosen run at both ends of the figures.
5. :mod:`~pipecut.planning.cluster.run` — the cost model of one training run, pure numbers:
   D replicas × K stages laid onto nodes, priced link by link, with
   :mod:`~pipecut.planning.cluster.stage` (one stage: FSDP units, checkpointing, state,
   collectives), :mod:`~pipecut.planning.cluster.schedule` (the schedule as it runs: virtual
   stages, the weight pass, live memory) and :mod:`~pipecut.planning.cluster.foreign` (what
   another runtime holds, for pricing a published run as it ran).
6. :mod:`~pipecut.planning.cluster.run_plan` — the per-stage plan of the chosen run.

The records it hands down and returns are plan data (:mod:`pipecut.cluster`: the cluster, its
links, the placement, the run's prediction).
"""

__all__: list[str] = []
