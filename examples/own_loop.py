"""Your own model and training loop on titanlite's pieces: FSDP2 (or a tensor-parallel plan of
your own), the checkpointer, the prepared-shard loader and the mesh-wide gradient clip.

    torchrun --standalone --nproc-per-node 2 examples/own_loop.py      # the built-in corpus, prepared once
    python -m titanlite.data.prepare my_texts/ /tmp/tokens --tokenizer assets/tokenizer/titanlite.model
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --data /tmp/tokens --steps 6 --ckpt /tmp/ckpt
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --data /tmp/tokens --steps 6 --ckpt /tmp/ckpt --tp 2

Every layout trains like one process (`python examples/own_loop.py ...`) on the same global
batch, and a checkpoint saved at one layout resumes at another (tests/runs/test_examples.py
saves at --tp 2 and resumes under FSDP on 2 ranks).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import titanlite
from titanlite.parallel import tensor_parallel as tp


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of them.
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Causal attention alone tells positions apart here (no positional embedding: a toy)."""

    def __init__(self, vocab: int = 4096, dim: int = 32, heads: int = 4, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tensor_parallel_plan(model: TinyTransformer, tp_mesh) -> None:
    """Megatron-style: q/k/v and the MLP's first linear by columns, o and the second by rows,
    the embedding and the head by vocab; every other weight replicated on the tp mesh (so the
    gradient norm counts each element once). Built from titanlite's plan helpers."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(
        model,
        tp_mesh,
        {
            "embed": tp.vocab_sharded_embedding(False),
            "norm": tp.norm(False),
            "head": tp.output_projection(False, False),
        },
    )
    for block in model.blocks:
        parallelize_module(
            block,
            tp_mesh,
            {
                "norm1": tp.norm(False),
                "attn": tp.block_entry(False),
                "attn.q": tp.ColwiseParallel(),
                "attn.k": tp.ColwiseParallel(),
                "attn.v": tp.ColwiseParallel(),
                "attn.o": tp.rowwise_exit(False),
                "norm2": tp.norm(False),
                "mlp": tp.block_entry(False),
                "mlp.0": tp.ColwiseParallel(),
                "mlp.2": tp.rowwise_exit(False),
            },
        )


BUILTIN_TOKENS = "outputs/examples/builtin-tokens"


def builtin_tokens(rank: int) -> str:
    """Text that ships with Python (its docs and standard library), prepared once with the
    bundled tokenizer by rank 0 while the others wait."""
    if rank == 0 and not (Path(BUILTIN_TOKENS) / "manifest.json").exists():
        titanlite.prepare(
            titanlite.build_source("builtin"), titanlite.Tokenizer("assets/tokenizer/titanlite.model"), BUILTIN_TOKENS
        )
    torch.distributed.barrier()
    return BUILTIN_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        help=f"a prepared token folder (default: the built-in corpus, prepared into {BUILTIN_TOKENS} on first use)",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel degree (the rest of the ranks shard with FSDP)"
    )
    parser.add_argument("--ckpt", help="checkpoint folder: resumes from it, saves every --save-every steps")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=4)
    args = parser.parse_args()

    info = titanlite.init_distributed()
    data_folder = args.data or builtin_tokens(info.rank)
    meshes = titanlite.build_mesh(tp=args.tp)
    dp_rank, dp = (meshes.dp.get_local_rank(), meshes.dp.size()) if meshes.dp is not None else (0, 1)
    torch.manual_seed(0)
    model = TinyTransformer()
    titanlite.parallelize(model, meshes, tp_plan=tensor_parallel_plan if args.tp > 1 else None, blocks={Block})
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = titanlite.prepared_loader(
        data_folder,
        seq_len=16,
        local_batch_size=args.global_batch // dp,
        dp_rank=dp_rank,
        dp_degree=dp,
        seed=0,
        prefetch=False,
    )
    checkpointer = (
        titanlite.Checkpointer(args.ckpt, model=model, optimizer=optimizer, states={"data": data}, keep_latest_k=2)
        if args.ckpt
        else None
    )
    start = (checkpointer.load() or 0) if checkpointer else 0
    for step in range(start + 1, args.steps + 1):
        inputs, labels = next(data)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        norm = titanlite.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        if meshes.dp is not None:  # the mean over data-parallel ranks: the global batch's loss
            torch.distributed.all_reduce(reported, group=meshes.dp.get_group())
            reported /= dp
        if info.rank == 0:
            print(f"step {step} loss {reported.item():.8f} grad_norm {norm.item():.6f}", flush=True)
        if checkpointer is not None and step % args.save_every == 0:
            checkpointer.save(step)
    if checkpointer is not None:
        checkpointer.close()
    torch.distributed.barrier()  # no rank tears its connections down while a peer still talks to it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
