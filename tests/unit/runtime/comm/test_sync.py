"""How compile's weight sync cuts a rank's tensors into messages (the sync itself runs in
tests/multiprocess/test_model_state.py)."""

from __future__ import annotations

import torch

from pipecut.runtime.comm.sync import _buckets


def test_weight_buckets_group_dtypes_and_respect_the_size_limit() -> None:
    tensors = [torch.zeros(10), torch.zeros(3, dtype=torch.int64), torch.zeros(20), torch.zeros(100),
               torch.zeros(5)]
    # float32: 40 + 80 bytes fit in 128; the 400-byte tensor travels alone; int64 on its own.
    assert _buckets(tensors, limit=128) == [[0, 2], [3], [4], [1]]
    assert _buckets(tensors) == [[0, 2, 3, 4], [1]]


def test_sent_module_state_is_cloned_and_nothing_else() -> None:
    from pipecut.runtime.execution.stage import _own, _storages

    module = torch.nn.BatchNorm1d(3)
    other = torch.zeros(3)
    sent = _own([module.running_mean, module.running_var[1:], other], _storages(module))
    assert sent[2] is other
    for got, state in zip(sent[:2], (module.running_mean, module.running_var[1:])):
        assert got.untyped_storage().data_ptr() != state.untyped_storage().data_ptr()
        assert torch.equal(got, state)
