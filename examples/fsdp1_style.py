"""FSDP1 code running on FSDP2: the only change is the import line of FullyShardedDataParallel.
Wrap with an auto-wrap policy, train, save one full checkpoint from rank 0 under
`summon_full_params`, load it into a plain unwrapped model and into a new wrapped one, and
save / load per-rank sharded state dicts with torch.distributed.checkpoint.

    torchrun --standalone --nproc-per-node 2 examples/fsdp1_style.py --out /tmp/fsdp1
    python examples/fsdp1_style.py --out /tmp/fsdp1          # the same loop on one process
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

import titanlite
from titanlite import FullyShardedDataParallel as FSDP  # was: from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 3):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(8, dim), nn.ModuleList(Block(dim) for _ in range(depth)), nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def batch(step: int, rank: int, world: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of `step` (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)
    rows = slice(rank * size // world, (rank + 1) * size // world)
    return x[rows], y[rows]


def wrap(seed: int) -> FSDP:
    torch.manual_seed(seed)
    return FSDP(Net(), auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                sharding_strategy=ShardingStrategy.FULL_SHARD, sync_module_states=True, use_orig_params=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the checkpoints")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    info = titanlite.init_distributed()
    rank, world, out = info.rank, info.world_size, Path(args.out)

    model = wrap(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, args.steps + 1):
        x, y = batch(step, rank, world)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(reported := loss.detach().clone())
        if rank == 0:
            print(f"step {step} loss {reported.item() / world:.8f}", flush=True)

    # One full checkpoint, written by rank 0 from whole parameters gathered into host memory.
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            torch.save(model.module.state_dict(), out / "full.pt")
    dist.barrier()
    probe = torch.randn(5, 8, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        expected = model(probe)
        plain = Net()  # no parallelism at all
        plain.load_state_dict(torch.load(out / "full.pt"))
        unwrapped = (plain(probe) - expected).abs().max().item()
        rewrapped_model = wrap(seed=1)  # FSDP1's FULL_STATE_DICT load: every rank reads the file
        rewrapped_model.load_state_dict(torch.load(out / "full.pt"))
        rewrapped = (rewrapped_model(probe) - expected).abs().max().item()

    # Per-rank sharded state dicts through torch.distributed.checkpoint.
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict()}, checkpoint_id=out / "sharded")
    restored = wrap(seed=2)
    with FSDP.state_dict_type(restored, StateDictType.SHARDED_STATE_DICT):
        state = {"model": restored.state_dict()}
        dcp.load(state, checkpoint_id=out / "sharded")
        restored.load_state_dict(state["model"])
    with torch.no_grad():
        sharded = (restored(probe) - expected).abs().max().item()
    if rank == 0:
        print(f"full checkpoint: unwrapped logits differ by {unwrapped:.3g}, rewrapped by {rewrapped:.3g}; "
              f"sharded checkpoint: by {sharded:.3g}", flush=True)
    dist.barrier()  # no rank tears its connections down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
