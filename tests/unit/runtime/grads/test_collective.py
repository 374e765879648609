"""The promises of ``pipecut.runtime.grads.collective`` that need no processes: loss weighting and the
refusals of options that would give a result other than the plain model's."""

from __future__ import annotations

import math

import pytest
import torch

import pipecut
from examples import mlp
from pipecut.options import LossReduction
from pipecut.runtime.grads.collective import loss_divisor, parse_loss_reduction, scale_loss_fn

CPU = torch.device("cpu")


def test_loss_reduction_accepts_strings_and_lists_the_options() -> None:
    assert parse_loss_reduction("sum") is LossReduction.SUM
    assert parse_loss_reduction(LossReduction.MEAN) is LossReduction.MEAN
    with pytest.raises(pipecut.InputError, match=r"unknown loss_reduction 'avg'; valid: 'mean', 'sum'"):
        parse_loss_reduction("avg")


def test_compile_refuses_an_unknown_reduction_before_any_process_group() -> None:
    model, inputs, loss_fn, target = mlp.build(4, width=8, depth=1)
    with pytest.raises(pipecut.InputError, match="unknown loss_reduction 'token'"):
        pipecut.compile(
            model, inputs, 2, loss_fn=loss_fn, target=target,
            runtime=pipecut.RuntimeOptions(loss_reduction="token"),
        )


def test_loss_divisor() -> None:
    assert loss_divisor(LossReduction.MEAN, 8, None) == 8
    assert loss_divisor(LossReduction.SUM, 8, None) == 1  # the sum over the whole batch
    assert loss_divisor(LossReduction.SUM, 8, torch.tensor(37)) == 37
    assert loss_divisor(LossReduction.SUM, 8, 37.0, replicas=2) == 18.5  # averaged over 2 replicas
    with pytest.raises(pipecut.InputError, match=r"normalizer=10 but .* loss_reduction='mean'"):
        loss_divisor(LossReduction.MEAN, 8, 10)
    for bad in (0, -3, math.nan, math.inf):
        with pytest.raises(pipecut.InputError, match="normalizer must be finite and > 0"):
            loss_divisor(LossReduction.SUM, 8, bad)
    with pytest.raises(pipecut.InputError, match=r"one-element tensor, got shape \(2,\)"):
        loss_divisor(LossReduction.SUM, 8, torch.tensor([1, 2]))
    with pytest.raises(pipecut.InputError, match="got str"):
        loss_divisor(LossReduction.SUM, 8, "12")


def test_a_scaler_that_checks_each_rank_alone_is_refused() -> None:
    plain = torch.amp.GradScaler("cpu", init_scale=4.0)
    with pytest.raises(pipecut.InputError, match="on each of the 2 pipeline ranks alone"):
        scale_loss_fn(plain, [0, 1], CPU)
    with pytest.raises(pipecut.InputError, match=r"must be a torch\.amp\.GradScaler"):
        scale_loss_fn(object(), [0, 1], CPU)
    assert scale_loss_fn(None, [0, 1], CPU) is None
    assert scale_loss_fn(torch.amp.GradScaler("cpu", enabled=False), [0, 1], CPU) is None
    scale = scale_loss_fn(plain, [0], CPU)  # one rank: nothing to agree on
    assert scale is not None and scale(torch.tensor(3.0)).item() == 12.0
