"""pipecut.core.batching: splitting a batch into microbatches along dimension 0."""

from __future__ import annotations

import pytest
import torch

from pipecut.core.batching import (
    batch_size,
    check_inputs,
    first_microbatch,
    split_by_sizes,
    split_microbatches,
)
from pipecut.errors import InputError


def test_split_cuts_tensors_and_repeats_other_values():
    x = torch.arange(12).reshape(6, 2)
    parts = split_microbatches({"x": x, "n": 3, "s": torch.tensor(1.0)}, 3, 6)
    assert len(parts) == 3
    assert torch.equal(torch.cat([p["x"] for p in parts]), x)
    assert all(p["n"] == 3 and p["s"].item() == 1.0 for p in parts)  # 0-d tensors are not batched


def test_split_by_sizes_allows_unequal_parts():
    parts = split_by_sizes((torch.arange(5),), [3, 2])
    assert [p[0].tolist() for p in parts] == [[0, 1, 2], [3, 4]]


def test_bad_splits_are_refused_with_the_fix():
    with pytest.raises(InputError, match="does not split into 4 equal microbatches; use a batch size that is a multiple of 4"):
        split_microbatches((torch.zeros(6),), 4, 6)
    with pytest.raises(InputError, match="microbatches must be at least 1, got 0"):
        split_microbatches((torch.zeros(6),), 0, 6)
    with pytest.raises(InputError, match=r"target: a tensor of shape \(5,\) does not have the batch size 6"):
        split_by_sizes(torch.zeros(5), [3, 3], "target")


def test_batch_size_needs_one_agreed_first_dimension():
    assert batch_size([torch.zeros(4, 2), {"m": torch.zeros(4)}, 7]) == 4
    with pytest.raises(InputError, match=r"disagree on the batch size \(first dimension\): \[3, 4\]"):
        batch_size([torch.zeros(4), torch.zeros(3)])
    with pytest.raises(InputError, match="no tensor with a batch dimension"):
        batch_size([torch.tensor(1.0), 2])


def test_first_microbatch_keeps_the_structure_and_checks_inputs():
    size, first = first_microbatch({"x": torch.arange(8)}, 4)
    assert size == 8 and first["x"].tolist() == [0, 1]
    check_inputs([torch.zeros(1)])
    with pytest.raises(InputError, match=r"example_inputs must be a tuple .* got Tensor; wrap a single tensor as"):
        first_microbatch(torch.zeros(8), 2)
