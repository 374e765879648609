"""Schedule generators: GPipe, 1F1B and interleaved 1F1B, zero bubble and ZBV."""

__all__: list[str] = []
