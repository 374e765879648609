"""FLOP and byte counts per node: matrix products counted forward and backward, views free."""

from __future__ import annotations

import torch

from pipecut.capture import capture
from pipecut.profile.flops import count_work, moved_bytes


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 32, bias=False)
        self.fc2 = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return self.fc2(torch.relu(y)).view(-1)


def test_linear_flops_and_bytes_by_hand():
    x = torch.randn(4, 16)
    captured = capture(Tiny(), (x,))
    work = count_work(captured, captured.flatten_inputs((x,)))
    fc = work["fc"]
    assert fc.forward_flops == 2 * 4 * 16 * 32
    # backward: the batch needs no gradient, so only the weight's (32x4 @ 4x16): one forward
    assert fc.backward_flops == fc.forward_flops
    # fc2's input needs a gradient too: input and weight gradients, twice its forward
    assert work["fc2"].backward_flops == 2 * work["fc2"].forward_flops == 2 * (2 * 4 * 32 * 32)
    assert fc.forward_bytes == 4 * (4 * 16 + 16 * 32 + 4 * 32)
    assert fc.backward_bytes == 2 * fc.forward_bytes
    relu = work["relu"]
    assert relu.forward_flops == 0 and relu.forward_bytes == 4 * 2 * 4 * 32
    assert work["view"].forward_bytes == 0  # a view moves nothing
    assert work["x"].forward_flops == 0


def test_loss_is_counted_on_the_output_node():
    x, y = torch.randn(4, 16), torch.randn(128)
    captured = capture(Tiny(), (x,))
    work = count_work(
        captured, captured.flatten_inputs((x,)), loss_fn=torch.nn.functional.mse_loss, target=y
    )
    assert work["output"].forward_bytes > 0 and work["output"].backward_bytes > 0


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(16, 1000, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def _float_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), target)


def test_a_loss_of_several_kernels_moves_the_bytes_of_each():
    x, y = torch.randn(64, 16, dtype=torch.bfloat16), torch.randint(0, 1000, (64,))
    captured = capture(Head(), (x,))
    loss = count_work(captured, captured.flatten_inputs((x,)), loss_fn=_float_cross_entropy, target=y)["output"]
    logits = 64 * 1000
    # the cast reads 2 and writes 4 bytes a logit, the log-softmax reads and writes 4 more each:
    # at least 14 bytes a logit, where a single op reading the logits once would count 2
    assert loss.forward_bytes >= 14 * logits
    assert loss.forward_bytes < 30 * logits  # no op counted twice over
    # backward: the log-softmax's gradient (reads 8, writes 4) and the cast's (reads 4, writes 2)
    assert loss.backward_bytes >= 14 * logits


def test_moved_bytes_counts_reads_and_writes():
    a = torch.zeros(10)
    assert moved_bytes((a,), a + 1) == 80
    assert moved_bytes((a,), a[2:]) == 0


class Attention(torch.nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_attention_on_the_cpu_is_counted_like_the_cuda_kernels():
    """torch's counter knows only the CUDA attention kernels; the CPU one (which a model on the
    CPU or on fake CPU tensors runs) gets the same formulas: QK^T and PV, 2·b·h·s²·d each."""
    b, h, s, d = 2, 4, 32, 8
    q = torch.randn(b, h, s, d, requires_grad=True)
    captured = capture(Attention(), (q,))
    work = count_work(captured, captured.flatten_inputs((q,)))
    node = next(name for name in work if "scaled_dot_product" in name)
    assert work[node].forward_flops == 2 * (2 * b * h * s * s * d)
    assert work[node].backward_flops == 5 * (2 * b * h * s * s * d)  # recomputed scores + four products
