"""Pipeline x data parallelism under torchrun: 2 stages x 2 replicas of the GPT example.

    torchrun --nproc_per_node=4 examples/hybrid.py [ddp|fsdp]

The four ranks form a DeviceMesh ("dp", "pp") of 2 x 2. Each replica trains on its own half of
the batch; each stage module is wrapped in DistributedDataParallel (or sharded with FSDP2
``fully_shard``) over its replicas, which average the gradients during the stage's last
backward, so a step equals the unsplit model's step on the whole batch. Rank 0 prints the
losses and checks them against the plain model trained on the whole batch in the same process.
The same script runs on several machines (docs/multinode.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecut
from examples.gpt import build


def main(data_parallel: str = "ddp", steps: int = 3) -> None:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    model, (tokens,), loss_fn, target = build(batch_size=16)
    half = slice(8 * replica, 8 * replica + 8)
    inputs, local_target = (tokens[half],), target[half]
    pipe = pipecut.compile(model, inputs, mesh, loss_fn=loss_fn, target=local_target,
                           microbatches=4, schedule="1f1b", data_parallel=data_parallel)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        losses.append(pipe.step(inputs, local_target).item())
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        plain, _, _, _ = build(batch_size=16)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        expected = []
        for _ in range(steps):
            loss = loss_fn(plain(tokens), target)
            loss.backward()
            plain_opt.step()
            plain_opt.zero_grad()
            expected.append(loss.item())
        print(f"pipelined x replicated ({data_parallel}):", [f"{x:.6f}" for x in losses])
        print("plain model, whole batch:", [f"{x:.6f}" for x in expected])
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        print("equal")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:2])
