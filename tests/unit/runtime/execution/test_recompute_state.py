"""pipecut.runtime.execution.recompute_state: a recompute sees the state its forward saw and writes none."""

from __future__ import annotations

import torch

from pipecut.runtime.execution.recompute_state import StateReplay


class _Counter(torch.nn.Module):
    """Reads a buffer it then increments: a recompute must see the value before the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mask", torch.ones(3))  # read, never written

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(x) * (self.calls + 1) * self.mask
        self.calls += 1
        return out


def test_the_replay_restores_what_each_forward_saw_and_drops_its_writes() -> None:
    m = _Counter()
    replay = StateReplay(m)
    xs = [torch.randn(4, 3) for _ in range(2)]
    outs = []
    for mb, x in enumerate(xs):
        with replay.forward(mb):
            outs.append(m(x))
    after = {n: b.clone() for n, b in m.named_buffers()}
    assert after["calls"] == 2 and after["bn.num_batches_tracked"] == 2
    for mb, x in enumerate(xs):  # as a recompute inside backward would run
        with replay.replaying(mb):
            torch.testing.assert_close(m(x), outs[mb])  # microbatch mb saw calls == mb
    for name, b in m.named_buffers():  # nothing written twice
        torch.testing.assert_close(b, after[name], rtol=0, atol=0, msg=name)
    assert m.mask is not None and replay._saved == {}  # only written buffers were kept, now dropped


def test_only_written_buffers_outlive_the_forward() -> None:
    m = _Counter()
    replay = StateReplay(m)
    with replay.forward(0):
        m(torch.randn(4, 3))
    kept = replay._saved[0]
    assert id(m.mask) not in kept and id(m.calls) in kept and id(m.bn.running_mean) in kept
    replay.reset()
    assert replay._saved == {}
