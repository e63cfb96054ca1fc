"""A small two-block network for the compat wrappers' one-rank unit tests, and the one-rank
gloo group they run in (the wrappers need a process group; a world of one shards nothing
but runs every code path of the wrappers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.relu(self.attn(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Linear(4, 8), nn.ModuleList([Block(), Block()]), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


@contextlib.contextmanager
def one_rank_group(monkeypatch) -> Iterator[None]:
    """A one-rank gloo group; the wrappers' default device is then the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
