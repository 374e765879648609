"""pipecut.planning.request: one planning request, its variants and its first microbatch."""

from __future__ import annotations

import dataclasses

import torch

from pipecut.ir import DeviceSpec
from pipecut.options import MeasureOptions, Options, ScheduleOptions
from pipecut.passes.partition.solve import DEFAULT_LINK
from pipecut.planning.request import FirstBatch, Request


def _request(**options) -> Request:
    return Request(model=torch.nn.Linear(3, 2), example_inputs=(torch.ones(8, 3),), target=torch.arange(8),
                   loss_fn=None, devices=2, specs=(DeviceSpec(name="cpu"),) * 2, options=Options(**options))


def test_a_variant_changes_only_what_it_names() -> None:
    r = _request(microbatches="auto", scheduling=ScheduleOptions(stages_per_rank=2))
    v = r.with_options(microbatches=4)
    assert v.options == Options(microbatches=4, scheduling=ScheduleOptions(stages_per_rank=2))
    assert r.options.microbatches == "auto"  # the request itself is unchanged
    assert v.stages_per_rank == 2 and _request().stages_per_rank == 1
    assert r.link == DEFAULT_LINK


def test_the_first_microbatch_of_inputs_and_target() -> None:
    batch = FirstBatch.of(_request(), 4)
    assert batch.batch_size == 8 and batch.inputs[0].shape == (2, 3)
    assert batch.target.tolist() == [0, 1]


def test_nodes_are_measured_where_asked_else_where_the_inputs_are() -> None:
    assert _request().measure_on == torch.device("cpu")
    assert _request(measure=MeasureOptions(device="meta")).measure_on == torch.device("meta")


def test_an_option_this_call_did_not_pass_says_where_its_value_came_from() -> None:
    carried = dataclasses.replace(_request(), unasked=(("runtime", "recorded in the replayed plan's options"),))
    assert carried.whence("runtime") == "recorded in the replayed plan's options"
    assert carried.whence("capture") == "" and _request().whence("runtime") == ""
    assert carried.with_options(microbatches=2).whence("runtime") == "recorded in the replayed plan's options"
