"""The Llama 2/3 decoder in one file: RoPE (with Llama 3.1 scaling), GQA, SwiGLU, RMSNorm.

The layout follows Meta's reference weights (interleaved RoPE pairs, `wq/wk/wv/wo`,
`w1/w2/w3`), so the tensor-parallel plan and the Hugging Face mapping can name modules
directly. Head counts are read from the weights at run time (`view(..., -1, head_dim)`),
so the same code runs with the full model or with the local shard a TP plan leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.init import ShardInit


@dataclass(frozen=True)
class LlamaArgs:
    """Hyperparameters of one Llama flavor; `vocab_size` is replaced by the tokenizer's."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1 frequency scaling: None (off) or (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings).
    rope_scaling: tuple[float, float, float, int] | None = None
    max_seq_len: int = 8192
    # Scale the init of each block's output projections by its depth (torchtitan's default).
    depth_init: bool = True

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, scaled, rounded up to `multiple_of` (Meta's rule)."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def rope_frequencies(args: LlamaArgs) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama 3.1's long-context scaling when set."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if args.rope_scaling is None:
        return freqs
    factor, low_freq_factor, high_freq_factor, old_context = args.rope_scaling
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rope_cos_sin(args: LlamaArgs, device: torch.device | str) -> torch.Tensor:
    """cos and sin for every position up to max_seq_len, stacked: [max_seq_len, head_dim/2, 2]."""
    positions = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, rope_frequencies(args))
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float().to(device)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1) of x: [batch, seq, heads, head_dim]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs.unbind(-1)
    cos, sin = cos_sin[: x.shape[1]].unsqueeze(1).unbind(-1)  # [seq, 1, head_dim/2]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.kv_repeats = args.n_heads // args.kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
        # GQA: each kv head serves kv_repeats query heads (also true of a TP shard).
        k = k.repeat_interleave(self.kv_repeats, dim=2)
        v = v.repeat_interleave(self.kv_repeats, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_proj_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos_sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, init: ShardInit) -> None:
        init.ones(self.attention_norm.weight)
        for linear in (self.attention.wq, self.attention.wk, self.attention.wv):
            init.trunc_normal(linear.weight, std=0.02)
        init.trunc_normal(self.attention.wo.weight, std=self.out_proj_std)
        init.ones(self.ffn_norm.weight)
        init.trunc_normal(self.feed_forward.w1.weight, std=0.02)
        for linear in (self.feed_forward.w2, self.feed_forward.w3):
            init.trunc_normal(linear.weight, std=self.out_proj_std)


class Llama(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("LlamaArgs.vocab_size must be set from the tokenizer")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."n-1" keeps parameter names stable when blocks are
        # wrapped (activation checkpointing, compile) and lets plans address blocks by name.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", rope_cos_sin(args, "meta"), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.rope_cache)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill this rank's shard of every parameter, with the values of the same elements in
        any other parallel layout (see models/init.py)."""
        self.rope_cache = rope_cos_sin(self.args, self.output.weight.device)
        init = ShardInit(self, seed)
        init.normal(self.tok_embeddings.weight, std=1.0)
        for block in self.layers.values():
            block.init_weights(init)
        init.ones(self.norm.weight)
        cutoff = 3 * self.args.dim**-0.5
        init.trunc_normal(self.output.weight, std=self.args.dim**-0.5, a=-cutoff, b=cutoff)
