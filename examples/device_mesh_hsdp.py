"""The DeviceMesh notes' HSDP example on titanlite: a 2D mesh handed to FSDP1's wrapper as
`device_mesh=` with HYBRID_SHARD (shard within a mesh row, replicate across rows); the only
change is the import line. The notes use 2 x 4 GPUs; here the mesh is (world / 2) x 2, or
1 x 1 on one process.

    torchrun --standalone --nproc-per-node 4 examples/device_mesh_hsdp.py
    torchrun --standalone --nproc-per-node 2 examples/device_mesh_hsdp.py   # 1 x 2
    python examples/device_mesh_hsdp.py                                      # one process
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import titanlite

# was: from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from titanlite.compat.fsdp1 import FullyShardedDataParallel as FSDP, ShardingStrategy

STEPS = 4


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def build(seed: int = 0) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel()


def batch(step: int, rank: int, world: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(size, 10, generator=g), torch.randn(size, 5, generator=g)
    rows = slice(rank * size // world, (rank + 1) * size // world)
    return x[rows], y[rows]


def train(model: nn.Module, steps: int, rank: int, world: int) -> dict[int, float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = {}
    for step in range(1, steps + 1):
        x, y = batch(step, rank, world)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
        losses[step] = reported.item() / world
    return losses


def main() -> None:
    info = titanlite.init_distributed()
    shard = min(2, info.world_size)
    mesh_2d = init_device_mesh(
        info.device.type, (info.world_size // shard, shard), mesh_dim_names=("replicate", "shard")
    )
    model = FSDP(build(), device_mesh=mesh_2d, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    for step, loss in train(model, STEPS, info.rank, info.world_size).items():
        if info.rank == 0:
            print(f"step {step} loss {loss:.8f}", flush=True)
    if info.rank == 0:
        print(
            f"mesh {tuple(mesh_2d.shape)}: net1.weight holds {model.module.net1.weight.to_local().numel()} of "
            f"{model.module.net1.weight.numel()} elements on rank 0",
            flush=True,
        )
    dist.barrier()  # no rank tears its connections down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
