"""Qwen3 and Qwen3-MoE: the shared decoder (models/decoder.py) with Qwen3's block.

What differs from the shared decoder's Llama-shaped defaults, as transformers' Qwen3Attention
and Qwen3MoeSparseMoeBlock have it:

- attention: an explicit `head_dim` (128 in every published size, not dim / n_heads), and an
  RMSNorm over each head's q and k (`q_norm`, `k_norm`, one weight of head_dim shared by the
  heads) applied before RoPE;
- RoPE in the half layout: the pairs rotated together are (x_i, x_{i + head_dim/2}), as in
  HF's `rotate_half`, so HF weights load by name alone (models/rope.py's `apply_rope_half`,
  on the same complex cos + i*sin table);
- the feed-forward: the shared SwiGLU (`intermediate_size`), or, in the blocks `moe_layer`
  picks (HF's `decoder_sparse_step` and `mlp_only_layers`), the shared MoE layer
  (models/moe.py) with a softmax router, top-k renormalized when `norm_topk_prob`, no
  shared experts, and the aux loss (`router_aux_loss_coef`).

Module names stay the shared decoder's (wq/wk/wv/wo, w1/w2/w3, attention_norm, ffn_norm), so
its tensor-parallel plan (models/decoder_tp.py), FSDP units and activation checkpointing apply
as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titanlite.model_spec import DecoderArgs
from titanlite.models.decoder import Attention, Decoder, DecoderBlock, FeedForward
from titanlite.models.init import ShardInit
from titanlite.models.moe import MoE, MoEArgs
from titanlite.models.rope import apply_rope_half


@dataclass(frozen=True)
class Qwen3Args(DecoderArgs):
    """Hyperparameters of one Qwen3 flavor (HF config.json names in brackets); `vocab_size`
    is replaced by the tokenizer's. The fields the shared decoder reads keep its (Llama's) names."""

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
    # The shared decoder reads this: Qwen3 has no RoPE frequency scaling.
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


class Qwen3Attention(Attention):
    """The shared GQA attention with an RMSNorm per head on q and k, before RoPE in the half
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


class Qwen3Block(DecoderBlock):
    """The shared block with Qwen3's attention, and the MoE layer where `moe_layer` says."""

    def make_attention(self, args: Qwen3Args) -> nn.Module:
        return Qwen3Attention(args)

    def make_feed_forward(self, layer_id: int, args: Qwen3Args) -> nn.Module:
        return MoE(args.dim, args.moe) if args.moe_layer(layer_id) else FeedForward(args.dim, args.hidden_dim)


class Qwen3(Decoder):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]: the shared decoder (embedding, RoPE
    table, masks, KV cache, context parallelism, pipeline-stage forward, init) around Qwen3 blocks."""

    block_class = Qwen3Block


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
