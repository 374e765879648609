"""Models in other dtypes than float32: the loss comes back in the loss's own dtype on every rank.

Regression (issue 27): under ``torch.set_default_dtype(torch.float64)`` an MLP at K = 2 with
1F1B returned ``5.3e-315`` on rank 0 and ``1.3563765`` (float32) on rank 1, where the plain
model's loss is ``1.356376546``: the loss was broadcast as float32 into a buffer the other
ranks made in the default dtype (float64), so rank 0 read half a float64's bytes. The
gradients were right. Now the loss travels as float64 with its dtype beside it
(``pipecut.runtime.grads.collective.share_loss``); here every rank's loss is checked in its dtype, bit
for bit the same on every rank, against the plain model, with every gradient.

Splits are pinned (``PartitionOptions(split=...)``, no calibration), so load on the machine
cannot move a cut and change the order in which anything is summed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import pipecut
from examples import mlp
from tests.harness import run_ranks
from tests.reference import pipeline_grads, reference

pytestmark = pytest.mark.dist

MICROBATCHES = 4
SPLITS = {2: ["layers.2"], 3: ["layers.1", "layers.3"]}

# float64: only the order of additions differs (microbatch gradients summed one after the
# other, against one full-batch reduction inside each matmul): a few ulps (1e-16) per addition
# over these small reductions, ~1e-14 at most. 1e-10 leaves a wide margin and still fails on a
# float32 round trip anywhere (6e-8 relative), let alone on a garbage value.
F64 = {"rtol": 1e-10, "atol": 1e-12}
# bf16 weights: every product and sum rounds to 8 bits of mantissa (eps 2^-8 = 3.9e-3). The
# pipeline rounds per microbatch and adds 4 microbatch gradients in bf16, the plain model
# rounds once over the full batch. The loss: at most a couple of ulps (2^-7 relative) apart,
# measured one ulp (2.3125 against 2.328125). Gradients: element by element, near-zero entries
# differ by more than any relative tolerance, so each tensor is compared as a whole, by the
# norm of the difference relative to the norm of the reference: measured under 6e-3; a
# missing or doubled microbatch (a quarter of the gradient) is 25% or more.
BF16_LOSS = {"rtol": 2e-2, "atol": 0.0}
BF16_GRAD_NORM = 5e-2


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _f64_default() -> tuple[torch.nn.Module, Any, Any, Any]:
    """The MLP built under the float64 default dtype: weights, inputs, loss all float64."""
    with default_dtype(torch.float64):
        return mlp.build(batch_size=16, width=16, depth=4)


def _doubled() -> tuple[torch.nn.Module, Any, Any, Any]:
    """``model.double()`` (and float64 inputs) while the default dtype stays float32."""
    model, (x,), loss_fn, y = mlp.build(batch_size=16, width=16, depth=4)
    return model.double(), (x.double(),), loss_fn, y


def _bf16() -> tuple[torch.nn.Module, Any, Any, Any]:
    """bf16 weights and inputs: the loss is bf16."""
    model, (x,), loss_fn, y = mlp.build(batch_size=16, width=16, depth=4)
    return model.to(torch.bfloat16), (x.to(torch.bfloat16),), loss_fn, y


BUILDS: dict[str, Callable[[], tuple[torch.nn.Module, Any, Any, Any]]] = {
    "default float64": _f64_default, "model.double()": _doubled, "bf16 weights": _bf16}
EXPECTED = {"default float64": torch.float64, "model.double()": torch.float64, "bf16 weights": torch.bfloat16}


def _ranks(rank: int, world: int, names: list[str]) -> list[dict[str, Any]]:
    out = []
    for name in names:
        # The whole scenario under the default dtype it was written for: only "default float64"
        # sets it, as the user's script would, before compile and for every step.
        with default_dtype(torch.float64 if name == "default float64" else torch.float32):
            model, inputs, loss_fn, target = BUILDS[name]()
            pipe = pipecut.compile(
                model, inputs, world, loss_fn=loss_fn, target=target,
                microbatches=MICROBATCHES, schedule="1f1b",
                partition=pipecut.PartitionOptions(split=SPLITS[world]),
                measure=pipecut.MeasureOptions(calibration_steps=0, repeats=1, warmup=0),
                runtime=pipecut.RuntimeOptions(timeout=60),
            )
            loss = pipe.step(inputs, target)
            out.append({"loss": loss, "grads": pipeline_grads(model, pipe), "stage": pipe.stage})
    return out


def _check(name: str, results: list[dict[str, Any]]) -> None:
    expected = EXPECTED[name]
    with default_dtype(torch.float64 if name == "default float64" else torch.float32):
        ref_loss, ref_grads = reference(BUILDS[name], MICROBATCHES, per_microbatch=False)
    assert ref_loss.dtype == expected  # the plain model's loss is in that dtype too
    bf16 = expected == torch.bfloat16
    merged: dict[str, torch.Tensor] = {}
    for r, res in enumerate(results):
        loss = res["loss"]
        assert loss.dtype == expected, f"{name}: rank {r} returned a {loss.dtype} loss, the model's is {expected}"
        # The same bits on every rank: each rank casts the same float64 message back.
        assert torch.equal(loss, results[-1]["loss"]), f"{name}: rank {r} {loss} != last rank {results[-1]['loss']}"
        torch.testing.assert_close(loss, ref_loss, **(BF16_LOSS if bf16 else F64),
                                   msg=lambda m, r=r: f"{name}: rank {r} loss: {m}")
        for fqn, g in res["grads"].items():
            assert g.dtype == expected, f"{name}: {fqn}.grad is {g.dtype}"
            merged[fqn] = g
    assert merged.keys() == ref_grads.keys()
    for fqn, ref in ref_grads.items():
        if bf16:
            error = torch.linalg.vector_norm((merged[fqn] - ref).double()) / torch.linalg.vector_norm(ref.double())
            assert error < BF16_GRAD_NORM, f"{name}: {fqn}: relative error {error:.3g} in norm"
        else:
            torch.testing.assert_close(merged[fqn], ref, **F64, msg=lambda m, n=fqn: f"{name}: {n}: {m}")


@pytest.mark.timeout(300)
def test_float64_bf16_and_double_losses_come_back_in_their_dtype_at_two_ranks() -> None:
    names = list(BUILDS)
    results = run_ranks(_ranks, 2, names, timeout=280)
    for i, name in enumerate(names):
        _check(name, [r[i] for r in results])


@pytest.mark.timeout(300)
def test_float64_loss_at_three_ranks_is_the_plain_models_on_every_rank() -> None:
    names = ["default float64"]
    results = run_ranks(_ranks, 3, names, timeout=280)
    assert [r[0]["stage"] for r in results] == [0, 1, 2]
    _check(names[0], [r[0] for r in results])
