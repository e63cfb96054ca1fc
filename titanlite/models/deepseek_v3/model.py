"""DeepSeek-V3 (and the DeepSeek-V2-Lite-shaped 16B): the shared decoder with multi-head
latent attention (attention.py) in every block, `n_dense_layers` dense SwiGLU blocks, then
mixture-of-experts blocks (models/moe.py: sigmoid or softmax scores, the expert bias,
group-limited top-k, routed scaling, shared experts), and a YaRN-scaled RoPE table over the
rotary part of each head (qk_rope_head_dim). Its hyperparameters are `DeepSeekV3Args` (model_args.py).

Names are torchtitan's (wq / wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo; w1/w2/w3;
attention_norm, ffn_norm), so the tensor-parallel plan and the Hugging Face mapping
(hf_adapter.py) address modules directly.

Multi-token prediction (DeepSeek-V3's MTP, `num_nextn_predict_layers` D): D `MTPBlock`s after
the blocks, in `layers` under the numbers DeepSeek's checkpoint gives them (n_layers .. n_layers
+ D - 1: layer 61 of the 671B), so FSDP, activation checkpointing, compile, context parallelism
and the pipeline split treat them as blocks (the last stage holds them). Depth k reads the
previous depth's hidden state h (the main blocks' output before the final norm for k = 1) and
the embeddings of the window shifted by k: eh_proj([enorm(emb) | hnorm(h)]) -> the block ->
its own norm (HF's `shared_head.norm`) -> the shared output head. The shifted windows come with
the tokens as streams (`step/mtp.py` builds them before any split), so every layout sees the
same numbers: [batch, 1 + D, seq] token ids in, [batch, (1 + D) x seq, vocab] logits out (the
main logits, then each depth's); between pipeline stages the streams' activations travel
together, [batch, 1 + D, seq, dim], so the last stage meets the embedding it does not hold.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.models.attention import Mask
from titanlite.models.decoder import Decoder, DecoderBlock, FeedForward
from titanlite.models.deepseek_v3.model_args import DeepSeekV3Args
from titanlite.models.deepseek_v3.attention import MLA
from titanlite.models.init import ShardInit
from titanlite.models.moe import MoE
from titanlite.models.rope import rope_cos_sin


class DeepSeekV3Block(DecoderBlock):
    """The shared pre-norm block with MLA, and the MoE layer where `moe_layer` says."""

    def make_attention(self, args: DeepSeekV3Args) -> nn.Module:
        return MLA(args)

    def make_feed_forward(self, layer_id: int, args: DeepSeekV3Args) -> nn.Module:
        return MoE(args.dim, args.moe) if args.moe_layer(layer_id) else FeedForward(args.dim, args.hidden_dim)


class MTPBlock(DeepSeekV3Block):
    """One multi-token prediction depth: (h, the shifted tokens' embeddings) -> (its hidden
    state, for the next depth; the same normalized, for the shared head)."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args):
        super().__init__(layer_id, args)
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self, h: torch.Tensor, embedded: torch.Tensor, cos_sin: torch.Tensor, mask: Mask = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = super().forward(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)), cos_sin, mask)
        return h, self.norm(h)

    def init_weights(self, init: ShardInit) -> None:
        super().init_weights(init)
        for norm in (self.enorm, self.hnorm, self.norm):
            init.ones(norm.weight)
        init.trunc_normal(self.eh_proj.weight, std=0.02)


class DeepSeekV3(Decoder):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]: the shared decoder's embedding,
    masks, context parallelism, KV cache, pipeline-stage forward and init around DeepSeek-V3
    blocks, with the RoPE table over each head's rotary part only."""

    block_class = DeepSeekV3Block

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        for layer_id in range(args.n_layers, args.n_layers + args.mtp_depths):
            self.layers[str(layer_id)] = MTPBlock(layer_id, args)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder.forward, with the MTP streams (module doc) when `tokens` has them: token ids
        [batch, 1 + D, seq] on the first stage, their activations [batch, 1 + D, seq, dim] after it."""
        embeds = self.tok_embeddings is not None
        if tokens.ndim == (2 if embeds else 3):  # no streams: the main model alone
            streams = [self.tok_embeddings(tokens) if embeds else tokens]
        else:
            streams = [self.tok_embeddings(ids) if embeds else ids for ids in tokens.unbind(1)]
        seq = tokens.shape[-1] if embeds else streams[0].shape[1] * self.sequence_shards
        cos_sin, masks = self.attention_inputs(seq, streams[0], document_ids)
        h, *shifted = streams
        depths = []
        for key, block in self.layers.items():
            if int(key) < self.args.n_layers:
                h = block(h, cos_sin, masks[key])
            else:
                depths.append((key, block))
        if self.output is None:  # a stage before the last hands every stream on
            return torch.stack([h, *shifted], dim=1) if shifted else h
        logits = [self.head(h)]
        for (key, block), embedded in zip(depths, shifted):
            h, normed = block(h, embedded, cos_sin, masks[key])
            logits.append(self.output(normed))
        return torch.cat(logits, dim=1)

    @staticmethod
    def rope_table(args: DeepSeekV3Args, device: torch.device | str) -> torch.Tensor:
        """[max_seq_len, qk_rope_head_dim / 2], YaRN-scaled when args.rope_scaling is set."""
        return rope_cos_sin(args, device, rotary_dim=args.qk_rope_head_dim)
