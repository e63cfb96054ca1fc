"""Megatron-core's FSDP2 wrapper on titanlite: the only change is the import line of
`TorchFullyShardedDataParallel`. A GPT built of Megatron-named modules, wrapped with
megatron-core's own config objects (`TransformerConfig`, `TorchFullyShardedDataParallelConfig`),
`sub_modules_to_wrap` and a submodule's `_fsdp_modules`; Megatron's training step
(microbatches under `no_sync`, `zero_grad_buffer`, `finish_grad_sync`, layers recomputed
under `recompute_granularity="full"`); then a sharded checkpoint through
torch.distributed.checkpoint, loaded into a new wrapper with `load_state_dict`.

    torchrun --standalone --nproc-per-node 2 examples/megatron_style.py --out /tmp/megatron
    python examples/megatron_style.py --out /tmp/megatron          # one process
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

import titanlite

# was: from megatron.core.distributed import TorchFullyShardedDataParallel
from titanlite.compat.megatron import TorchFullyShardedDataParallel

STEPS, MICROBATCHES, VOCAB = 4, 2, 64


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        # No qkv bias: its key part gets a gradient that is zero but for rounding, which
        # AdamW scales up to full-size steps, so layouts would differ there and nowhere else.
        self.linear_qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.linear_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.linear_qkv(x).chunk(3, dim=-1))
        return self.linear_proj(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        )


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = (
            nn.Linear(config.hidden_size, config.ffn_hidden_size),
            nn.Linear(config.ffn_hidden_size, config.hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.input_layernorm, self.self_attention = nn.LayerNorm(config.hidden_size), SelfAttention(config)
        self.pre_mlp_layernorm, self.mlp = nn.LayerNorm(config.hidden_size), MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size)
        self._fsdp_modules = [MLP]  # Megatron: more classes to shard on their own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.config.recompute_granularity == "full" else layer(x)
        return self.final_layernorm(x)


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, config.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(tokens)


class GPTModel(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.embedding, self.decoder = LanguageModelEmbedding(config), TransformerBlock(config)
        self.output_layer = nn.Linear(config.hidden_size, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.decoder(self.embedding(tokens)))


def transformer_config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )


def build(seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(transformer_config())


def microbatches(step: int, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's microbatches of the global batch of `step` (4 sequences of 17 tokens per microbatch)."""
    tokens = torch.randint(0, VOCAB, (MICROBATCHES, 4, 17), generator=torch.Generator().manual_seed(step))
    return [mb[rank * 4 // world : (rank + 1) * 4 // world] for mb in tokens]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int, world: int) -> dict[int, float]:
    """Megatron's step: gradients accumulate over the microbatches unreduced, one reduction at the end."""
    losses = {}
    for step in steps:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        total = torch.zeros(())
        batches = microbatches(step, rank, world)
        for index, tokens in enumerate(batches):
            with model.no_sync() if index < len(batches) - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()) / len(batches)
                loss.backward()
            total += loss.detach()
        model.finish_grad_sync()
        optimizer.step()
        if world > 1:
            dist.all_reduce(total)
        losses[step] = total.item() / world
    return losses


def wrap(model: GPTModel) -> TorchFullyShardedDataParallel:
    return TorchFullyShardedDataParallel(
        model.decoder.config,
        TorchFullyShardedDataParallelConfig(reshard_after_forward=True),
        model,
        sub_modules_to_wrap={TransformerLayer, LanguageModelEmbedding},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/examples/megatron_style", help="folder for the checkpoint")
    args = parser.parse_args()
    info = titanlite.init_distributed()
    rank, world = info.rank, info.world_size
    model = wrap(build())
    if rank == 0:
        units = [name for name, m in model.module.named_modules() if name and isinstance(m, FSDPModule)]
        print(f"FSDP units: {', '.join(units)}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, loss in train(model, optimizer, range(1, STEPS + 1), rank, world).items():
        if rank == 0:
            print(f"step {step} loss {loss:.8f}", flush=True)

    # Megatron's checkpoint: the sharded state dict through DCP, loaded in place, then load_state_dict.
    dcp.save(model.state_dict(), checkpoint_id=Path(args.out) / "checkpoint")
    restored = wrap(build(seed=1))
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=Path(args.out) / "checkpoint")
    restored.load_state_dict(state)
    probe = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        difference = (restored(probe) - model(probe)).abs().max().item()
    if rank == 0:
        print(f"sharded checkpoint: restored model differs by {difference:.3g}", flush=True)
    dist.barrier()  # no rank tears its connections down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
