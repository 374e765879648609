"""State in and out: checkpoints, weights read into stages, ``save_pretrained``.

:mod:`~pipecut.runtime.state.checkpoint` (distributed checkpoints of a pipeline),
:mod:`~pipecut.runtime.state.weights` (where a stage's weights are read from),
:mod:`~pipecut.runtime.state.materialize` (a meta stage made real and loaded),
:mod:`~pipecut.runtime.state.pretrained` (Hugging Face names of saved weights) and
:mod:`~pipecut.runtime.state.export` (each rank writes its stage as safetensors).
None of them imports :mod:`pipecut.runtime.pipeline` at run time: the pipeline calls them.
"""

__all__: list[str] = []
