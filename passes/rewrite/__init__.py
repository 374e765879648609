"""Graph rewrites: stage programs, the other train/eval mode, shapes, recompute segments, row pieces."""

__all__: list[str] = []
