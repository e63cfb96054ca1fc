"""A GPT-2-style decoder in one file: learned positions, pre-LayerNorm blocks with biases,
fused qkv attention, GELU MLP, untied output head.

Fused qkv and tensor parallelism. `attn.c_attn` is one Linear(dim, 3 * dim). Hugging Face's
GPT-2 stores its output rows as [all q | all k | all v]; sharding that by columns (rows of
the weight) would give rank 0 of 2 all of q and half of k, mixing the three. Here the rows
are stored per head instead: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], each piece `head_dim` rows.
A plain ColwiseParallel split then hands each rank whole heads with their own q, k and v, and
the forward only needs `view(batch, seq, heads, 3, head_dim)` to take them apart, with the
local head count read from the shape, so the same code runs unsharded or on a TP shard.
(Loading Hugging Face weights means permuting c_attn's rows (and bias) into this order.)

Positions: `embeddings` adds `wpe(arange(seq))` to `wte(tokens)`. Under TP the token
lookup leaves reduce-scattered onto sequence shards and the replicated position table is
added to it as a DTensor, which slices it to the local positions (see parallelize.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.model_spec import DecoderArgs
from titanlite.models.attention import Mask, attend, build_mask
from titanlite.models.init import ShardInit


@dataclass(frozen=True)
class GPT2Args(DecoderArgs):
    """Hyperparameters of one GPT-2 flavor; `vocab_size` is replaced by the tokenizer's. The rest
    the planner reads is DecoderArgs' default: head_dim dim / n_heads, no GQA, no QK norms, an
    untied head, no MoE, and GPT-2's MLP width, 4 x dim (`ffn_hidden_dim`)."""

    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = -1
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    # "causal" or "block_causal" (each token sees only its own document): models/attention.py.
    attn_mask_type: str = "causal"


class Embeddings(nn.Module):
    """Token plus learned absolute position embeddings: [batch, seq] -> [batch, seq, dim]."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))  # [b, s, d] + [s, d]


class Attention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.head_dim
        # Output rows interleaved per head: [q_h, k_h, v_h] for h = 0..n_heads-1 (see above).
        self.c_attn = nn.Linear(args.dim, 3 * args.dim, bias=True)
        self.c_proj = nn.Linear(args.dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.c_attn(x).view(batch, seq, -1, 3, self.head_dim)  # -1: local heads
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # each [b, heads, s, head_dim]
        out = attend(q, k, v, mask, grouped=False)
        return self.c_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.c_fc = nn.Linear(args.dim, args.ffn_hidden_dim, bias=True)
        self.c_proj = nn.Linear(args.ffn_hidden_dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = Attention(args)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args)
        # GPT-2's residual scaling: each block adds two projections to the residual stream.
        self.out_proj_std = 0.02 / (2 * args.n_layers) ** 0.5

    def forward(self, x: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        h = x + self.attn(self.ln_1(x), mask)
        return h + self.mlp(self.ln_2(h))

    def init_weights(self, init: ShardInit) -> None:
        for norm in (self.ln_1, self.ln_2):
            init.ones(norm.weight)
            init.zeros(norm.bias)
        for linear, std in (
            (self.attn.c_attn, 0.02),
            (self.attn.c_proj, self.out_proj_std),
            (self.mlp.c_fc, 0.02),
            (self.mlp.c_proj, self.out_proj_std),
        ):
            init.normal(linear.weight, std=std)
            init.zeros(linear.bias)


class GPT2(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("GPT2Args.vocab_size must be set from the tokenizer")
        self.args = args
        self.embeddings = Embeddings(args)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] (or a later pipeline stage's input activations); document_ids
        [batch, seq] with block_causal attention. A pipeline stage holds None for the modules
        of other stages and passes the activations through (parallel/pipeline.py)."""
        h = self.embeddings(tokens) if self.embeddings is not None else tokens
        mask = build_mask(self.args.attn_mask_type, document_ids, None, None, flex=h.is_cuda)
        for block in self.layers.values():
            h = block(h, mask)
        if self.ln_f is not None:
            h = self.ln_f(h)
        return self.lm_head(h) if self.lm_head is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill this rank's shard of every parameter, with the values of the same elements in
        any other parallel layout (see models/init.py)."""
        init = ShardInit(self, seed)
        if self.embeddings is not None:
            init.normal(self.embeddings.wte.weight, std=0.02)
            init.normal(self.embeddings.wpe.weight, std=0.02)
        for block in self.layers.values():
            block.init_weights(init)
        if self.ln_f is not None:
            init.ones(self.ln_f.weight)
            init.zeros(self.ln_f.bias)
        if self.lm_head is not None:
            init.normal(self.lm_head.weight, std=0.02)
