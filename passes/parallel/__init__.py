"""Data × pipeline parallelism: uniform and per-stage replicas, and a run on a cluster."""

__all__: list[str] = []
