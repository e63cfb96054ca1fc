"""Qwen3 and Qwen3-MoE: Llama's decoder (models/llama/model.py) with Qwen3's block.

What differs from Llama, as transformers' Qwen3Attention and Qwen3MoeSparseMoeBlock have it:

- attention: an explicit `head_dim` (128 in every published size, not dim / n_heads), and an
  RMSNorm over each head's q and k (`q_norm`, `k_norm`, one weight of head_dim shared by the
  heads) applied before RoPE;
- RoPE in the half layout: the pairs rotated together are (x_i, x_{i + head_dim/2}), as in
  HF's `rotate_half`, so HF weights load by name alone. The frequencies and the complex
  cos + i*sin table are Llama's (`rope_cos_sin`), read as cos and sin here;
- the feed-forward: Llama's SwiGLU (`intermediate_size`), or, in the blocks `moe_layer`
  picks (HF's `decoder_sparse_step` and `mlp_only_layers`), the shared MoE layer
  (models/moe.py) with a softmax router, top-k renormalized when `norm_topk_prob`, no
  shared experts, and the aux loss (`router_aux_loss_coef`).

Module names stay Llama's (wq/wk/wv/wo, w1/w2/w3, attention_norm, ffn_norm), so Llama's
tensor-parallel plan, FSDP units and activation checkpointing apply as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titanlite.models.init import ShardInit
from titanlite.models.llama.model import Attention, FeedForward, Llama, TransformerBlock
from titanlite.models.moe import MoE, MoEArgs
from titanlite.parallel.context_parallel import ContextParallel


@dataclass(frozen=True)
class Qwen3Args:
    """Hyperparameters of one Qwen3 flavor (HF config.json names in brackets); `vocab_size`
    is replaced by the tokenizer's. The fields Llama's decoder reads keep Llama's names."""

    dim: int = 1024  # [hidden_size]
    n_layers: int = 28  # [num_hidden_layers]
    n_heads: int = 16  # [num_attention_heads]
    n_kv_heads: int = 8  # [num_key_value_heads]
    head_dim: int = 128  # [head_dim]
    hidden_dim: int = 3072  # the dense SwiGLU width [intermediate_size]
    vocab_size: int = -1
    norm_eps: float = 1e-6  # [rms_norm_eps]
    rope_theta: float = 1_000_000.0  # [rope_theta]
    max_seq_len: int = 40960  # [max_position_embeddings]
    tie_word_embeddings: bool = False  # [tie_word_embeddings]
    # Mixture-of-experts feed-forward (Qwen3-MoE); None: every block dense.
    moe: MoEArgs | None = None
    # Which blocks are MoE: block i when (i + 1) % decoder_sparse_step == 0 and i is not in
    # mlp_only_layers [decoder_sparse_step, mlp_only_layers].
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    depth_init: bool = True  # depth-scaled init of the output projections, as Llama's
    attn_mask_type: str = "causal"  # models/attention.py
    # Llama's decoder reads these: Qwen3 has no RoPE frequency scaling.
    rope_scaling: None = None

    def __post_init__(self) -> None:
        if self.decoder_sparse_step < 1:
            raise ValueError(f"Qwen3Args.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def qk_norm(self) -> bool:
        """q and k are normalized per head (the planner counts the norms' inputs)."""
        return True

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    def moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has the MoE feed-forward (HF's Qwen3MoeDecoderLayer rule)."""
        return (
            self.moe is not None
            and (layer_id + 1) % self.decoder_sparse_step == 0
            and layer_id not in self.mlp_only_layers
        )

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layer(i) for i in range(self.n_layers))


def apply_rope_half(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x_i, x_{i + head_dim/2}) of x [batch, seq, heads, head_dim] by the
    angles of `cos_sin` (Llama's complex table [seq, head_dim/2]), in float32: HF's
    `x * cos + rotate_half(x) * sin`."""
    first, second = x.float().unflatten(-1, (2, -1)).unbind(-2)
    rotation = cos_sin[: x.shape[1]].unsqueeze(1)  # [seq, 1, head_dim/2] over the heads
    cos, sin = rotation.real, rotation.imag
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).type_as(x)


class Qwen3Attention(Attention):
    """Llama's GQA attention with an RMSNorm per head on q and k, before RoPE in the half
    layout. The norms see whatever heads this rank holds (all, or a TP shard's)."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope_half(self.q_norm(q), cos_sin), apply_rope_half(self.k_norm(k), cos_sin)

    def init_weights(self, init: ShardInit, out_std: float) -> None:
        super().init_weights(init, out_std)
        init.ones(self.q_norm.weight)
        init.ones(self.k_norm.weight)


class Qwen3Block(TransformerBlock):
    """Llama's block with Qwen3's attention, and the MoE layer where `moe_layer` says."""

    def make_attention(self, args: Qwen3Args) -> nn.Module:
        return Qwen3Attention(args)

    def make_feed_forward(self, layer_id: int, args: Qwen3Args) -> nn.Module:
        return MoE(args.dim, args.moe) if args.moe_layer(layer_id) else FeedForward(args.dim, args.hidden_dim)


class Qwen3(Llama):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]: Llama's embedding, RoPE table,
    masks, KV cache, pipeline-stage forward and init around Qwen3 blocks."""

    block_class = Qwen3Block

    def enable_context_parallel(self, context_parallel: ContextParallel) -> None:
        """As Llama's, and each MoE layer sums its aux loss's token counts over the cp ranks."""
        super().enable_context_parallel(context_parallel)
        for block in self.layers.values():
            if isinstance(block.feed_forward, MoE):
                block.feed_forward.context_parallel = context_parallel


def qwen3_moe(n_experts: int, top_k: int, hidden_dim: int, **extra) -> MoEArgs:
    """Qwen3-MoE's layer: softmax router, top-k renormalized (norm_topk_prob), no shared
    experts, aux loss 0.001, computed per sequence (MoEArgs.aux_loss_per_sequence: the form
    every parallel layout trains alike; transformers pools a forward's tokens)."""
    return MoEArgs(
        n_experts=n_experts,
        top_k=top_k,
        hidden_dim=hidden_dim,
        score_func="softmax",
        renormalize=True,
        aux_loss_coef=1e-3,
        aux_loss_per_sequence=True,
        **extra,
    )
