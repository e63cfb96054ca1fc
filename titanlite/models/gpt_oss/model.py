"""gpt-oss (OpenAI's open-weight MoE, 20B and 120B): the shared decoder with its attention and
its MoE blocks, as transformers' GptOssForCausalLM computes them.

- attention: the shared GQA attention with biases on q/k/v/o, an explicit `head_dim`, RoPE in
  the half layout (HF's `rotate_half`) on a YaRN table (`truncate` false), and a learned sink
  logit per head in every row's softmax denominator (`sinks`, models/attention.attend);
  every other block (HF's `layer_types`, sliding first) attends within a sliding window of
  `sliding_window` tokens, a mask the decoder builds per window (models/decoder.py);
- feed-forward: the shared MoE layer (models/moe.py) in every block: a router with a bias,
  top-k of its logits with the softmax over those k (the full softmax renormalized over the
  top k: the same weights), and gpt-oss's experts (moe_experts.ClampedSwiGLUExperts: biases,
  the clamped SwiGLU with alpha and limit, HF's fused interleaved layout).

Module names stay the shared decoder's (wq/wk/wv/wo, attention_norm, ffn_norm, feed_forward),
so its tensor-parallel plan, FSDP units and activation checkpointing apply as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titanlite.model_spec import DecoderArgs
from titanlite.models.decoder import Attention, Decoder, DecoderBlock
from titanlite.models.init import ShardInit
from titanlite.models.moe import MoE, MoEArgs
from titanlite.models.rope import YaRN, apply_rope_half

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssArgs(DecoderArgs):
    """Hyperparameters of one gpt-oss flavor (HF config.json names in brackets); `vocab_size`
    is replaced by the tokenizer's."""

    dim: int = 2880  # [hidden_size]
    n_layers: int = 24  # [num_hidden_layers]
    n_heads: int = 64  # [num_attention_heads]
    n_kv_heads: int = 8  # [num_key_value_heads]
    head_dim: int = 64  # [head_dim]
    vocab_size: int = -1
    moe: MoEArgs | None = None  # every block's MoE layer [num_local_experts, intermediate_size, ...]
    window: int = 128  # the sliding layers' window [sliding_window]
    # Each block's attention [layer_types]; empty: sliding, full, sliding, ... (HF's default).
    layer_types: tuple[str, ...] = ()
    norm_eps: float = 1e-5  # [rms_norm_eps]
    rope_theta: float = 150000.0  # [rope_parameters.rope_theta]
    rope_scaling: YaRN | None = YaRN(factor=32.0, original_max_position_embeddings=4096, truncate=False)
    max_seq_len: int = 131072  # [max_position_embeddings]
    attn_mask_type: str = "causal"  # models/attention.py
    depth_init: bool = True  # depth-scaled init of the output projections, as Llama's

    def __post_init__(self) -> None:
        if self.moe is None:
            raise ValueError("GptOssArgs.moe must be set: every gpt-oss block is MoE")
        if self.layer_types and (len(self.layer_types) != self.n_layers or set(self.layer_types) - {SLIDING, FULL}):
            raise ValueError(f"GptOssArgs.layer_types must be {self.n_layers} of {SLIDING!r} / {FULL!r}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.moe.hidden_dim

    def layer_type(self, layer_id: int) -> str:
        """HF's `layer_types[layer_id]`: given, or sliding on even blocks and full on odd ones."""
        return self.layer_types[layer_id] if self.layer_types else (SLIDING if layer_id % 2 == 0 else FULL)

    def sliding_window(self, layer_id: int) -> int | None:
        return self.window if self.layer_type(layer_id) == SLIDING else None

    def moe_layer(self, layer_id: int) -> bool:
        return True


class GptOssAttention(Attention):
    """The shared GQA attention with biases, RoPE in the half layout, and a sink logit per head."""

    def __init__(self, args: GptOssArgs):
        super().__init__(args, bias=True)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope_half(q, cos_sin), apply_rope_half(k, cos_sin)

    def init_weights(self, init: ShardInit, out_std: float) -> None:
        """The projections as the shared attention's, their biases and the sinks zero (a sink
        of 0 takes exp(0) of each row's softmax mass at first, as a key whose score is 0)."""
        super().init_weights(init, out_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            init.zeros(linear.bias)
        init.zeros(self.sinks)


class GptOssBlock(DecoderBlock):
    """The shared block with gpt-oss's attention and its MoE layer."""

    def make_attention(self, args: GptOssArgs) -> nn.Module:
        return GptOssAttention(args)

    def make_feed_forward(self, layer_id: int, args: GptOssArgs) -> nn.Module:
        return MoE(args.dim, args.moe)


class GptOss(Decoder):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]: the shared decoder (embedding, YaRN
    RoPE table, masks per window, KV cache, context parallelism, pipeline-stage forward, init)
    around gpt-oss blocks. No flex masks: the sinks need kernels that return a log-sum-exp."""

    block_class = GptOssBlock
    flex_masks = False


def gpt_oss_moe(n_experts: int, hidden_dim: int, **extra) -> MoEArgs:
    """gpt-oss's layer: a biased router, top 4 of the softmax renormalized (= softmax of the top 4
    logits), the clamped SwiGLU experts (alpha 1.702, limit 7), no shared experts; trained with
    the aux loss (`router_aux_loss_coef`), per sequence (the form every layout trains alike)."""
    values = dict(top_k=4, renormalize=True, router_bias=True, clamped_swiglu=(1.702, 7.0), aux_loss_coef=1e-3)
    values.update(aux_loss_per_sequence=True, **extra)
    return MoEArgs(n_experts=n_experts, hidden_dim=hidden_dim, score_func="softmax", **values)
