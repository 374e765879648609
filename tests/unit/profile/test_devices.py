"""Device profiles and roofline estimates: plan for 8 A100s that are not here."""

from __future__ import annotations

import json

import pytest
import torch

import pipecut
from pipecut.core.kinds import CostSource, NodeOp
from pipecut.errors import InputError
from pipecut.ir import Plan
from pipecut.passes.partition.solve import partition_costs
from pipecut.profile.devices import (
    DeviceProfile,
    Precision,
    device_link,
    device_profile,
    device_profiles,
    device_specs,
    roofline_ms,
)
from pipecut.schema import validate_plan_dict


def test_shipped_profiles_are_complete_and_nominal():
    names = {p.name for p in device_profiles()}
    assert {"A100-40GB", "A100-80GB", "H100-SXM", "V100-SXM2-32GB", "L4", "T4", "RTX-4090"} <= names
    for p in device_profiles():
        assert p.memory_bytes > 0 and p.memory_bandwidth_bytes_per_s > 0 and p.link_bytes_per_s > 0
        assert p.peak_flops(Precision.FP32) > 0 and p.datasheet
    a100 = device_profile("a100-80gb")
    # NVIDIA's 80 GB is nvidia-smi's 81920 MiB (device_profiles.json's memory_source)
    assert a100.peak_flops(Precision.BF16) == 312e12 and a100.memory_bytes == 81920 * 2**20


def test_unknown_device_and_precision_name_the_choices():
    with pytest.raises(InputError, match="A100-80GB"):
        device_profile("B300")
    with pytest.raises(InputError, match=r"no bf16 peak.*fp32"):
        device_profile("V100-SXM2-32GB").peak_flops(Precision.BF16)


def test_roofline_by_hand():
    p = DeviceProfile(name="x", memory_bytes=1, memory_bandwidth_bytes_per_s=1e12,
                      flops=((Precision.FP32, 1e12),), interconnect="", link_bytes_per_s=1e9,
                      datasheet="")
    # 1e9 FLOPs at 1e12 FLOP/s: 1 ms; 1e8 bytes at 1e12 B/s: 0.1 ms; compute-bound
    assert roofline_ms(1e9, 1e8, p, Precision.FP32, compute_efficiency=1, memory_efficiency=1) == pytest.approx(1.0)
    assert roofline_ms(0, 1e9, p, Precision.FP32, compute_efficiency=1, memory_efficiency=0.5) == pytest.approx(2.0)
    assert device_link("H100-SXM").bandwidth_bytes_per_ms == 450e6
    assert [d.memory_bytes for d in device_specs("L4", 3)] == [23034 * 2**20] * 3  # nvidia-smi's total (memory_source)


def test_plan_eight_a100s_from_estimated_costs(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    nodes = pipecut.estimate_costs(model, (x,), "A100-80GB", precision="tf32", microbatches=2,
                                   loss_fn=torch.nn.functional.mse_loss, target=y)
    assert all(n.source is CostSource.ESTIMATED for n in nodes)
    linear = [n for n in nodes if n.op is NodeOp.CALL_MODULE]
    assert len(linear) == 8 and all(n.forward_ms > 0 and n.backward_ms > 0 for n in linear)
    # the 8x64 @ 64x64 product of one microbatch is memory-bound on an A100: bytes / bandwidth
    nbytes = 4 * (8 * 64 + 64 * 64 + 64 + 8 * 64)
    assert linear[0].forward_ms == pytest.approx(nbytes / (2039e9 * 0.8) * 1e3)
    plan = partition_costs(nodes, devices=device_specs("A100-80GB", 8),
                           link=device_link("A100-80GB"), microbatches=2, batch_size=16)
    assert plan.num_stages == 8 and plan.devices[0].name == "A100-80GB"
    data = json.loads(plan.to_json(tmp_path / "plan.json"))
    validate_plan_dict(data)
    assert {n["source"] for n in data["nodes"]} == {"estimated"}
    assert Plan.from_json(tmp_path / "plan.json") == plan


def test_bad_precision_is_refused_before_running():
    with pytest.raises(InputError, match="unknown precision 'int4'"):
        pipecut.estimate_costs(torch.nn.Linear(2, 2), (torch.randn(2, 2),), precision="int4")
    # FP8 prices a framework's FP8 linears, not a whole model
    with pytest.raises(InputError, match="precision 'fp8' prices only a framework's FP8 linears"):
        pipecut.estimate_costs(torch.nn.Linear(2, 2), (torch.randn(2, 2),), "H100-SXM", precision="fp8")
    with pytest.raises(InputError, match="T4 has no bf16"):
        pipecut.estimate_costs(torch.nn.Linear(2, 2), (torch.randn(2, 2),), "T4", precision="bf16")


def test_an_estimate_for_a_gpu_counts_dropouts_mask_at_a_byte_and_a_cpu_plan_what_the_cpu_keeps():
    """Linear(8, 16) -> Dropout(0.1) -> Linear(16, 4) in bf16 on 4 rows. The dropout node keeps its
    output (the second Linear's input: 4 x 16 x 2 = 128 bytes) and its mask: on a GPU a bool,
    4 x 16 x 1 = 64 bytes, so 192; on the CPU the plan runs on, noise of the input's dtype,
    4 x 16 x 2 = 128 bytes, so 256."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4))
    model = model.to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)

    def dropout_saved(nodes):
        (node,) = [n for n in nodes if n.target == "1"]  # the Sequential's second module
        return node.saved_bytes

    assert dropout_saved(pipecut.estimate_costs(model, (x,), "H100-SXM")) == 128 + 64
    estimated = pipecut.plan(model, (x,), 1, microbatches=1, measure=pipecut.MeasureOptions(estimate="H100-SXM"))
    measured = pipecut.plan(model, (x,), 1, microbatches=1, measure=pipecut.MeasureOptions(repeats=1, warmup=0))
    assert dropout_saved(estimated.nodes) == 128 + 64
    assert dropout_saved(measured.nodes) == 128 + 128
