"""PyTorch FSDP1's own usage (the v1.12 API page) on titanlite: the only change is the import
line. A custom auto-wrap policy in v1.12's `(module, recurse, unwrapped_params)` form, an
init function through `apply` (whole parameters), training with gradient clipping, then a
checkpoint of the whole model and the whole optimizer state saved on rank 0
(`full_optim_state_dict`), resumed four ways, each continuing the same losses:
`scatter_full_optim_state_dict` (rank 0's copy scattered), `shard_full_optim_state_dict`
(every rank reads the file), a plain unwrapped model and optimizer through
`rekey_optim_state_dict`, and the later API's `optim_state_dict` / `optim_state_dict_to_load`
under SHARDED_STATE_DICT with torch.distributed.checkpoint.

    torchrun --standalone --nproc-per-node 2 examples/fsdp1_style.py --out /tmp/fsdp1
    python examples/fsdp1_style.py --out /tmp/fsdp1          # one process
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

import titanlite

# was: from torch.distributed.fsdp import (
#     FullyShardedDataParallel as FSDP, FullStateDictConfig, OptimStateKeyType, StateDictType,
# )
from titanlite.compat.fsdp1 import (
    FullyShardedDataParallel as FSDP,
    FullStateDictConfig,
    OptimStateKeyType,
    StateDictType,
)

STEPS, RESUME_AT = 6, 3


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 3):
        super().__init__()
        self.inp, self.blocks, self.out = (
            nn.Linear(8, dim),
            nn.ModuleList(Block(dim) for _ in range(depth)),
            nn.Linear(dim, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def custom_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, min_num_params: int = int(1e8)
) -> bool:
    """The v1.12 page's custom policy: wrap what holds at least `min_num_params` unwrapped parameters."""
    return unwrapped_params >= min_num_params


def init_weights(module: nn.Module) -> None:
    """Run through `apply`: sees whole weights, so one seed gives every layout the same model."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.1)
        nn.init.zeros_(module.bias)


def build(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int, rank: int, world: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of `step` (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)
    rows = slice(rank * size // world, (rank + 1) * size // world)
    return x[rows], y[rows]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    rank: int,
    world: int,
    clip: Callable[[float], torch.Tensor],
) -> dict[int, float]:
    """The loop every layout (and the plain model) runs: the global mean loss of each step."""
    losses = {}
    for step in steps:
        x, y = batch(step, rank, world)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        clip(1.0)
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
        losses[step] = reported.item() / world
    return losses


def wrapped(seed: int) -> tuple[FSDP, torch.optim.Optimizer]:
    model = FSDP(
        build(seed),
        auto_wrap_policy=functools.partial(custom_auto_wrap_policy, min_num_params=1000),
        sync_module_states=True,
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def report(name: str, losses: dict[int, float], rank: int) -> None:
    if rank == 0:
        for step, loss in losses.items():
            print(f"{name} step {step} loss {loss:.8f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/examples/fsdp1_style", help="folder for the checkpoints")
    args = parser.parse_args()
    info = titanlite.init_distributed()
    rank, world, out = info.rank, info.world_size, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model, optim = wrapped(seed=0)
    torch.manual_seed(1)
    model.apply(init_weights)
    if rank == 0:
        print(
            f"FSDP modules: {len(FSDP.fsdp_modules(model))}, roots: {len(FSDP.fsdp_modules(model, root_only=True))}",
            flush=True,
        )
    report("train", train(model, optim, range(1, RESUME_AT + 1), rank, world, model.clip_grad_norm_), rank)

    # Save: the whole model and the whole optimizer state, gathered onto rank 0.
    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ):
        model_state = model.state_dict()
    full_osd = FSDP.full_optim_state_dict(model, optim)
    if rank == 0:
        torch.save({"model": model_state, "optim": full_osd}, out / "checkpoint.pt")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save(
            {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, checkpoint_id=out / "sharded"
        )
    dist.barrier()
    rest = range(RESUME_AT + 1, STEPS + 1)

    # Resume 1: rank 0 reads the file and scatters the optimizer state.
    checkpoint = torch.load(out / "checkpoint.pt") if rank == 0 else None
    model, optim = wrapped(seed=2)
    model.load_state_dict(_broadcast(checkpoint["model"] if rank == 0 else None))
    optim.load_state_dict(FSDP.scatter_full_optim_state_dict(checkpoint["optim"] if rank == 0 else None, model))
    report("scatter", train(model, optim, rest, rank, world, model.clip_grad_norm_), rank)

    # Resume 2: every rank reads the file and keeps its shard of the optimizer state.
    checkpoint = torch.load(out / "checkpoint.pt")
    model, optim = wrapped(seed=3)
    model.load_state_dict(checkpoint["model"])
    optim.load_state_dict(FSDP.shard_full_optim_state_dict(checkpoint["optim"], model))
    report("shard", train(model, optim, rest, rank, world, model.clip_grad_norm_), rank)

    # Resume 3: a plain model and optimizer on rank 0, no wrapper, re-keyed by parameter id.
    if rank == 0:
        plain = build(seed=4)
        plain.load_state_dict(checkpoint["model"])
        plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        plain_optim.load_state_dict(FSDP.rekey_optim_state_dict(checkpoint["optim"], OptimStateKeyType.PARAM_ID, plain))
        clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(plain.parameters()))
        report("plain", train(plain, plain_optim, rest, 0, 1, clip), rank)

    # Resume 4: the sharded checkpoint through optim_state_dict_to_load.
    model, optim = wrapped(seed=5)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=out / "sharded")
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    report("sharded", train(model, optim, rest, rank, world, model.clip_grad_norm_), rank)
    dist.barrier()  # no rank tears its connections down while a peer still talks to it
    dist.destroy_process_group()


def _broadcast(state: dict | None) -> dict:
    """Rank 0's dict on every rank (FULL_STATE_DICT loads take the same whole tensors everywhere)."""
    box = [state]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
