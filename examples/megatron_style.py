"""Megatron-style FSDP2: shard a set of submodule classes, nested ones included (a transformer
layer and the attention and MLP inside it each get their own FSDP unit, innermost first),
the way Megatron's torch FSDP2 path names `sub_modules_to_wrap`; then a full state dict
saved from rank 0 and loaded into a plain model and, from rank 0 alone, into a sharded one.

    torchrun --standalone --nproc-per-node 2 examples/megatron_style.py
    python examples/megatron_style.py                      # the same loop on one process
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

import titanlite


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attention, self.ln2, self.mlp = nn.LayerNorm(dim), SelfAttention(dim, heads), nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.decoder = nn.ModuleList(TransformerLayer(dim, heads) for _ in range(depth))
        self.final_ln, self.output_layer = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.decoder:
            x = layer(x)
        return self.output_layer(self.final_ln(x))


SUB_MODULES_TO_WRAP = {TransformerLayer, SelfAttention, MLP, nn.Embedding}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    info = titanlite.init_distributed()
    rank, world = info.rank, info.world_size
    meshes = titanlite.build_mesh()  # every rank shards (dp_shard = the world)
    torch.manual_seed(0)
    model = GPT()
    titanlite.parallelize(model, meshes, blocks={TransformerLayer}, fsdp_modules=SUB_MODULES_TO_WRAP, ac="full")
    if rank == 0:
        units = [name or "(root)" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        print(f"FSDP units: {', '.join(units)}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
        mine = tokens[rank * 4 // world : (rank + 1) * 4 // world]
        loss = F.cross_entropy(model(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        titanlite.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(reported := loss.detach().clone())
        if rank == 0:
            print(f"step {step} loss {reported.item() / world:.8f}", flush=True)

    # Whole weights on rank 0 (host memory), loadable with no parallelism; and back into a
    # freshly sharded model from rank 0's copy alone (broadcast, each rank keeps its shard).
    state = titanlite.full_state_dict(model)
    probe = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        expected = model(probe)
        torch.manual_seed(1)
        fresh = titanlite.parallelize(GPT(), meshes, blocks={TransformerLayer}, fsdp_modules=SUB_MODULES_TO_WRAP)
        titanlite.load_full_state_dict(fresh, state if rank == 0 else {})
        reloaded = (fresh(probe) - expected).abs().max().item()
        if rank == 0:
            plain = GPT()
            plain.load_state_dict(state)
            print(f"full state dict: plain model differs by {(plain(probe) - expected).abs().max().item():.3g}, "
                  f"resharded model by {reloaded:.3g}", flush=True)
    dist.barrier()  # no rank tears its connections down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
