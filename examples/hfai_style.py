"""hfai's FSDP usage on titanlite: the only change is the import line. Wrap with hfai's
size-based policy, train, then hfai's two checkpoints: the whole model, taken under
`model.summon_full_params()` and saved by rank 0 (an unwrapped model loads it as it is, a new
wrapper loads it back under `summon_full_params()`), and each rank's own pieces
(`model{rank}.pt`, outside `summon_full_params`), loaded back per rank at the same layout.

    torchrun --standalone --nproc-per-node 2 examples/hfai_style.py --out /tmp/hfai
    python examples/hfai_style.py --out /tmp/hfai              # one process
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import titanlite

# was: from hfai.distributed.fsdp import FullyShardedDataParallel as FSDP, size_based_auto_wrap_policy
from titanlite.compat.hfai import FullyShardedDataParallel as FSDP, size_based_auto_wrap_policy

STEPS = 4


class Net(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(depth)
        )
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def build(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int, rank: int, world: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of `step` (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)
    rows = slice(rank * size // world, (rank + 1) * size // world)
    return x[rows], y[rows]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int, world: int) -> dict[int, float]:
    """The loop, wrapped or not: the global mean loss of each step."""
    losses = {}
    for step in range(1, steps + 1):
        x, y = batch(step, rank, world)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
        losses[step] = reported.item() / world
    return losses


def wrap(model: nn.Module) -> FSDP:
    return FSDP(model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/examples/hfai_style", help="folder for the checkpoints")
    args = parser.parse_args()
    info = titanlite.init_distributed()
    rank, world, out = info.rank, info.world_size, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = wrap(build())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, loss in train(model, optimizer, STEPS, rank, world).items():
        if rank == 0:
            print(f"step {step} loss {loss:.8f}", flush=True)

    # The whole model: gathered under summon_full_params, written by rank 0.
    with model.summon_full_params():
        state = model.state_dict()
    if rank == 0:
        torch.save(state, out / "model.pt")
    # Each rank's own pieces, outside summon_full_params.
    torch.save(model.state_dict(), out / f"model{rank}.pt")
    dist.barrier()

    probe = torch.randn(5, 8, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        expected = model(probe)
        plain = build(seed=1)
        plain.load_state_dict(torch.load(out / "model.pt"))  # no wrapper at all
        whole = wrap(build(seed=2))
        with whole.summon_full_params():
            whole.load_state_dict(torch.load(out / "model.pt"))
        local = wrap(build(seed=3))
        local.load_state_dict(torch.load(out / f"model{rank}.pt"))
        differences = [(m(probe) - expected).abs().max().item() for m in (plain, whole, local)]
    if rank == 0:
        print(
            "whole checkpoint: unwrapped model differs by {:.3g}, rewrapped by {:.3g}; "
            "per-rank checkpoint: by {:.3g}".format(*differences),
            flush=True,
        )
    dist.barrier()  # no rank tears its connections down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
