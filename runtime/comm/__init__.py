"""Communication between ranks: process groups, transfers and their order, failures.

:mod:`~pipecut.runtime.comm.launch` (process-group set-up), :mod:`~pipecut.runtime.comm.wire`
(a cut value over the wire, shaped by the plan), :mod:`~pipecut.runtime.comm.p2p` (the order of
a rank's transfers), :mod:`~pipecut.runtime.comm.nccl` (that order replayed under NCCL's rules),
:mod:`~pipecut.runtime.comm.linkprobe` (a link's bandwidth, measured),
:mod:`~pipecut.runtime.comm.sync` (every rank starts from rank 0's weights),
:mod:`~pipecut.runtime.comm.failure` (fail fast) and :mod:`~pipecut.runtime.comm.teardown`.
"""

__all__: list[str] = []
