"""DeepSeek-V3 (and the DeepSeek-V2-Lite-shaped 16B): the shared decoder with multi-head
latent attention (attention.py) in every block, `n_dense_layers` dense SwiGLU blocks, then
mixture-of-experts blocks (models/moe.py: sigmoid or softmax scores, the expert bias,
group-limited top-k, routed scaling, shared experts), and a YaRN-scaled RoPE table over the
rotary part of each head (qk_rope_head_dim).

Names are torchtitan's (wq / wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo; w1/w2/w3;
attention_norm, ffn_norm), so the tensor-parallel plan and the Hugging Face mapping
(hf_adapter.py) address modules directly. Multi-token prediction is not built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titanlite.models.decoder import Decoder, DecoderBlock, FeedForward
from titanlite.models.deepseek_v3.attention import MLA
from titanlite.models.moe import MoE, MoEArgs
from titanlite.models.rope import YaRN, rope_cos_sin
from titanlite.model_spec import AttentionWidths, DecoderArgs


@dataclass(frozen=True)
class DeepSeekV3Args(DecoderArgs):
    """Hyperparameters of one DeepSeek-V3 flavor (HF config.json names in brackets);
    `vocab_size` is replaced by the tokenizer's. MLA has no one head_dim: the planner reads
    `attention_widths`."""

    dim: int = 2048  # [hidden_size]
    n_layers: int = 27  # [num_hidden_layers]
    n_heads: int = 16  # [num_attention_heads]
    vocab_size: int = -1
    q_lora_rank: int = 0  # 0: one query projection wq [q_lora_rank, None in HF]
    kv_lora_rank: int = 512  # [kv_lora_rank]
    qk_nope_head_dim: int = 128  # [qk_nope_head_dim]
    qk_rope_head_dim: int = 64  # [qk_rope_head_dim]
    v_head_dim: int = 128  # [v_head_dim]
    hidden_dim: int = 10944  # the dense blocks' SwiGLU width [intermediate_size]
    moe: MoEArgs | None = None  # the MoE blocks' layer; None: every block dense
    n_dense_layers: int = 1  # dense blocks before the MoE ones [first_k_dense_replace]
    norm_eps: float = 1e-6  # [rms_norm_eps]
    rope_theta: float = 10000.0  # [rope_theta]
    rope_scaling: YaRN | None = None  # [rope_scaling]
    max_seq_len: int = 4096  # [max_position_embeddings]
    tie_word_embeddings: bool = False  # [tie_word_embeddings]
    attn_mask_type: str = "causal"  # models/attention.py
    depth_init: bool = True  # depth-scaled init of the output projections, as Llama's

    def __post_init__(self) -> None:
        if self.q_lora_rank < 0 or min(self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim) <= 0:
            raise ValueError(f"DeepSeekV3Args: ranks and head dims must be positive: {self}")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepSeekV3Args.qk_rope_head_dim must be even and positive, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key width: [nope | rope]."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when
        YaRN has mscale_all_dim (transformers' yarn_apply_mscale)."""
        if self.rope_scaling is None:
            return self.qk_head_dim**-0.5
        return self.rope_scaling.softmax_scale(self.qk_head_dim)

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    @property
    def attention_widths(self) -> AttentionWidths:
        """Per token: queries and keys n_heads x qk_head_dim (the rope part rotated), values and
        the output projection's input n_heads x v_head_dim; whole on every tp rank, the latents
        autograd keeps: wkv_a's output, the normalized latent and [latent | k_pe] (gathered
        under cp), and with the low-rank query path wq_a's output and its norm's."""
        qk, v = self.n_heads * self.qk_head_dim, self.n_heads * self.v_head_dim
        kv_latent = 2 * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        return AttentionWidths(q=qk, k=qk, v=v, out=v, latent=kv_latent + 2 * self.q_lora_rank)

    def moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has the MoE feed-forward (HF's first_k_dense_replace rule)."""
        return self.moe is not None and layer_id >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layer(i) for i in range(self.n_layers))


class DeepSeekV3Block(DecoderBlock):
    """The shared pre-norm block with MLA, and the MoE layer where `moe_layer` says."""

    def make_attention(self, args: DeepSeekV3Args) -> nn.Module:
        return MLA(args)

    def make_feed_forward(self, layer_id: int, args: DeepSeekV3Args) -> nn.Module:
        return MoE(args.dim, args.moe) if args.moe_layer(layer_id) else FeedForward(args.dim, args.hidden_dim)


class DeepSeekV3(Decoder):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]: the shared decoder's embedding,
    masks, context parallelism, KV cache, pipeline-stage forward and init around DeepSeek-V3
    blocks, with the RoPE table over each head's rotary part only."""

    block_class = DeepSeekV3Block

    @staticmethod
    def rope_table(args: DeepSeekV3Args, device: torch.device | str) -> torch.Tensor:
        """[max_seq_len, qk_rope_head_dim / 2], YaRN-scaled when args.rope_scaling is set."""
        return rope_cos_sin(args, device, rotary_dim=args.qk_rope_head_dim)
