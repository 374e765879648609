"""The cost model: a plan's stages and their step, node costs at any microbatch size, workloads."""

__all__: list[str] = []
