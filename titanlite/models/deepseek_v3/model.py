"""DeepSeek-V3 (and the DeepSeek-V2-Lite-shaped 16B): the shared decoder with multi-head
latent attention (attention.py) in every block, `n_dense_layers` dense SwiGLU blocks, then
mixture-of-experts blocks (models/moe.py: sigmoid or softmax scores, the expert bias,
group-limited top-k, routed scaling, shared experts), and a YaRN-scaled RoPE table over the
rotary part of each head (qk_rope_head_dim). Its hyperparameters are `DeepSeekV3Args` (model_args.py).

Names are torchtitan's (wq / wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo; w1/w2/w3;
attention_norm, ffn_norm), so the tensor-parallel plan and the Hugging Face mapping
(hf_adapter.py) address modules directly. Multi-token prediction is not built.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.models.decoder import Decoder, DecoderBlock, FeedForward
from titanlite.models.deepseek_v3.model_args import DeepSeekV3Args
from titanlite.models.deepseek_v3.attention import MLA
from titanlite.models.moe import MoE
from titanlite.models.rope import rope_cos_sin


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
