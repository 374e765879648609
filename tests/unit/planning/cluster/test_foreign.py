"""A published run's runtime priced as it holds memory (torchtitan's loss parallelism, torch's
pipelining keeping the last stage's outputs and a receive buffer per microbatch): the sizes on
a hand-computable workload, and no change at all where the behaviour does not arise (T = 1,
K = 1, no terms)."""

from __future__ import annotations

import pytest

from pipecut.cluster import Cluster, Layout, Link
from pipecut.core.kinds import Recompute
from pipecut.passes.costs.workload import Workload
from pipecut.planning.cluster.foreign import (
    RuntimeTerm,
    kept_output_bytes,
    loss_workspace_bytes,
    receive_buffer_bytes,
    with_runtime,
)
from pipecut.planning.cluster.run import RunCandidate, RunShape, block_of, evaluate_run
from pipecut.planning.cluster.schedule import peak_activations
from pipecut.planning.cluster.stage import stage_work
from pipecut.schedules.format import parse_schedule

LOGITS = 1000
"""Logit elements of one microbatch at the table's (all replicas') size: 2 B each, bf16."""
BOTH = (RuntimeTerm.LOSS_PARALLEL, RuntimeTerm.PIPELINE_KEEPS_OUTPUTS)
LINK = Link(name="nvlink", bandwidth_bytes_per_ms=4e8, latency_ms=0.01)


def model() -> Workload:
    """Two blocks, the head, the loss (8 B a logit kept, pipecut's count) and the output node
    (a unit without work)."""
    return Workload(
        forward_ms=(1.0, 1.0, 1.0, 1.0, 0.0), backward_ms=(2.0, 2.0, 2.0, 2.0, 0.0),
        param_bytes=(100, 100, 100, 0, 0), activation_bytes=(50, 50, 20, 8 * LOGITS, 0),
        cut_forward_bytes=(0, 40, 40, 2 * LOGITS, 4, 0), cut_backward_bytes=(0, 40, 40, 2 * LOGITS, 0, 0),
        modules=("layers.0", "layers.1", "lm_head", "", ""),
    )


def test_loss_parallel_workspace_is_16_bytes_a_local_logit_less_what_the_loss_keeps() -> None:
    # 2 replicas: 500 logits a GPU; 16 x 500 = 8,000 at the backward's peak, 4,000 already kept
    assert loss_workspace_bytes(model(), 0, 5, 2, 8) == 4000.0
    assert loss_workspace_bytes(model(), 2, 5, 1, 2) == 8000.0
    assert loss_workspace_bytes(model(), 0, 5, 2, 1) == 0.0  # T = 1: no loss parallelism
    assert loss_workspace_bytes(model(), 0, 2, 2, 8) == 0.0  # the stage does not hold the loss


def test_the_pipelines_last_stage_keeps_each_microbatchs_logits() -> None:
    assert kept_output_bytes(model(), 2, 5, 2, 4) == 1000.0  # 2,000 B of bf16 logits over 2 replicas
    assert kept_output_bytes(model(), 0, 2, 2, 4) == 0.0  # not the last stage
    assert kept_output_bytes(model(), 0, 5, 2, 1) == 0.0  # K = 1: no pipeline


def test_the_loss_workspace_takes_the_recompute_transients_place_never_adds_to_it() -> None:
    st = stage_work(model(), block_of(model().modules), 0, 5, 2, Recompute.FULL)
    assert st.transient_bytes == 25.0  # one block's activations, 50 / 2
    out = with_runtime(st, model(), 0, 5, replicas=2, ranks=1, tensor_parallel=8, microbatches=4, terms=BOTH)
    assert (out.transient_bytes, out.held_bytes) == (4000.0, 0.0)
    assert with_runtime(st, model(), 0, 5, replicas=2, ranks=1, tensor_parallel=1, microbatches=4, terms=BOTH) == st
    assert with_runtime(st, model(), 0, 5, replicas=2, ranks=4, tensor_parallel=8, microbatches=4, terms=()) is st


def test_receive_buffers_a_stage_holds_per_microbatch() -> None:
    # the cut after layers.1 carries 40 B (20 a replica) each way
    assert receive_buffer_bytes(model(), 0, 2, 2, 2) == (0.0, 20.0)  # first stage: no input buffer
    assert receive_buffer_bytes(model(), 2, 5, 2, 2) == (20.0, 0.0)  # holds the loss: no gradient buffer
    assert receive_buffer_bytes(model(), 1, 2, 2, 3) == (20.0, 20.0)
    assert receive_buffer_bytes(model(), 0, 2, 2, 1) == (0.0, 0.0)  # K = 1: no pipeline
    st = stage_work(model(), block_of(model().modules), 2, 5, 2, Recompute.FULL)
    out = with_runtime(st, model(), 2, 5, replicas=2, ranks=2, tensor_parallel=1, microbatches=4,
                       terms=(RuntimeTerm.PIPELINE_BUFFERS,))
    # 4 input buffers stand all step; the input a microbatch keeps is its buffer, not counted twice
    assert (out.standing_bytes, out.left_bytes, st.kept_bytes - out.kept_bytes) == (80.0, 20.0, 20.0)


def test_held_bytes_stay_until_the_step_ends() -> None:
    one_rank = parse_schedule("0F0 0B0 0F1 0B1")
    assert peak_activations(one_rank, [10.0], [0.0], [1.0]) == (11.0,)
    # each forward adds 3 that no backward frees: 3 + 10 + 3 live at 0B1, plus its transient
    assert peak_activations(one_rank, [10.0], [0.0], [1.0], [3.0]) == (17.0,)
    # each backward leaves 2 that no action frees: 2 + 10 live at 0B1, plus its transient
    assert peak_activations(one_rank, [10.0], [0.0], [1.0], (), [2.0]) == (13.0,)


def run(k: int, t: int, terms: tuple[RuntimeTerm, ...]) -> RunCandidate:
    gpus = 2 * k * t
    cluster = Cluster(nodes=1, gpus_per_node=gpus, device="X", memory_bytes=10**12, peak_flops=1e15,
                      intra=LINK, inter=LINK)
    shape = RunShape(batch_size=8, microbatches=4, tokens_per_sample=10, model_flops_per_token=1.0,
                     recompute=Recompute.FULL, tensor_parallel=t, runtime_terms=terms)
    out = evaluate_run(model(), block_of(model().modules), shape, cluster, replicas=2, stages=k,
                       layout=Layout.STAGES_INSIDE_NODES)
    assert isinstance(out, RunCandidate)
    return out


def test_a_run_with_the_terms_holds_exactly_what_they_size() -> None:
    # K = 2: the last rank keeps 4 microbatches' logits (4 x 1,000) by the last backward
    with_terms, without = run(2, 1, BOTH), run(2, 1, ())
    assert with_terms.bounds[1] <= 3  # the loss is on the last stage
    assert with_terms.rank_memory_bytes[-1] - without.rank_memory_bytes[-1] == 4000
    assert with_terms.rank_memory_bytes[0] == without.rank_memory_bytes[0]
    # T = 2, K = 1: the loss's workspace (4,000) in place of one block's recompute (25)
    assert run(1, 2, BOTH).peak_memory_bytes - run(1, 2, ()).peak_memory_bytes == 4000 - 25


def test_a_pipelines_receive_buffers_on_each_rank() -> None:
    with_terms, without = run(2, 1, (RuntimeTerm.PIPELINE_BUFFERS,)), run(2, 1, ())
    assert with_terms.bounds == (0, 2, 5)
    # rank 0: 4 gradient buffers of 20 B stand; nothing else moves
    assert with_terms.rank_memory_bytes[0] - without.rank_memory_bytes[0] == 80
    # last rank (1F1B: F0 B0 F1 B1 ...): 4 input buffers stand (80); at B3, its peak, the
    # microbatch's input is its buffer (-20) and B0..B2 left their input gradients (+60)
    assert with_terms.rank_memory_bytes[1] - without.rank_memory_bytes[1] == 80 - 20 + 60


@pytest.mark.parametrize("k", [1, 2])
def test_without_tensor_parallelism_or_a_pipeline_nothing_moves(k: int) -> None:
    terms = (*BOTH, RuntimeTerm.PIPELINE_BUFFERS) if k == 1 else (RuntimeTerm.LOSS_PARALLEL,)
    assert run(k, 1, terms) == run(k, 1, ())
