"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention, as transformers'
DeepseekV3Attention computes it (weights named as torchtitan's).

- queries: one projection `wq` (q_lora_rank 0, the 16B flavor), or a low-rank path `wq_a`
  -> RMSNorm `q_norm` -> `wq_b`; each head's query is [q_nope | q_pe];
- keys and values from one compressed latent: `wkv_a` gives [latent | k_pe] per token; the
  latent, normalized (`kv_norm`), is up-projected per head by `wkv_b` into [k_nope | v];
  k_pe, one rotary key shared by every head, is appended to each head's k_nope;
- RoPE (interleaved pairs) on q_pe and k_pe only; v's head dim (v_head_dim) differs from the
  query/key head dim (qk_nope + qk_rope);
- the softmax scale is qk_head_dim ** -0.5, times YaRN's mscale squared when the RoPE
  table is YaRN-scaled with mscale_all_dim (DeepSeekV3Args.softmax_scale).

The heads are read from the weights at run time (`view(..., -1, head_dim)`), so the same
code runs whole or on the heads a TP shard of wq/wq_b/wkv_b leaves; the latents (wq_a,
wkv_a, q_norm, kv_norm) are the same on every tp rank.

Context parallelism gathers each cp rank's compressed latent and rotated k_pe (kv_lora_rank
+ qk_rope_head_dim numbers a token, one collective) rather than the materialized keys and
values (heads x (qk_head_dim + v_head_dim)): each rank then up-projects the whole window.
A KV cache (generation) keeps the materialized keys and values, as Llama's does.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.models.attention import Mask, attend
from titanlite.models.deepseek_v3.model_args import DeepSeekV3Args
from titanlite.models.init import ShardInit
from titanlite.models.kv_cache import LayerKVCache
from titanlite.models.rope import apply_rope
from titanlite.parallel.context_parallel import ContextParallel

# transformers' DeepseekV3RMSNorm default, which its q_a_layernorm and kv_a_layernorm keep
# (config.rms_norm_eps is the blocks' norms' only).
LATENT_NORM_EPS = 1e-6


class RopeKey(nn.Module):
    """The rotary key all heads share, handed to each of `heads` heads: [batch, seq,
    qk_rope_head_dim] -> [batch, seq, heads, qk_rope_head_dim] (a view). A module of its own
    because it is where a tensor every tp rank holds whole meets the heads a rank holds: the
    TP plan sums its gradient over the tp ranks there (deepseek_v3/parallelize.py)."""

    def forward(self, k_pe: torch.Tensor, heads: int) -> torch.Tensor:
        return k_pe.unsqueeze(2).expand(-1, -1, heads, -1)


class MLA(nn.Module):
    """x [batch, seq, dim], the RoPE table's rows for these positions (complex [seq,
    qk_rope_head_dim / 2]) and the mask -> [batch, seq, dim]."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = args.qk_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.softmax_scale = args.softmax_scale
        query_width = args.n_heads * args.qk_head_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, query_width, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, query_width, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.rope_key = RopeKey()
        self.context_parallel: ContextParallel | None = None  # set by the decoder's enable_context_parallel
        self.kv_cache: LayerKVCache | None = None  # set by the decoder's enable_kv_cache (generation only)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.query(x).view(batch, seq, -1, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # [batch, heads, seq, qk_head_dim]: made in the layout attention reads (no copy on CPU), as are the keys
        q = torch.cat([q_nope.transpose(1, 2), apply_rope(q_pe, cos_sin).transpose(1, 2)], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos_sin).squeeze(2)  # rotated at this rank's positions
        latent = torch.cat([self.kv_norm(latent), k_pe], dim=-1)
        if self.context_parallel is not None:  # every cp rank's latents, in one collective
            (latent,) = self.context_parallel.gather((latent,), dim=1)
        k, v = self.keys_and_values(latent)
        if self.kv_cache is not None:  # generation: every earlier token's keys and values too
            k, v = self.kv_cache.extend(k, v)
        out = attend(q, k.transpose(1, 2), v.transpose(1, 2), mask, False, self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """Every head's [q_nope | q_pe], flat: [batch, seq, heads * qk_head_dim]."""
        return self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))

    def keys_and_values(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[normalized latent | rotated k_pe] [batch, seq, kv_lora_rank + qk_rope_head_dim] ->
        keys [batch, seq, heads, qk_head_dim] (k_pe the same in every head) and values
        [batch, seq, heads, v_head_dim]."""
        batch, seq, _ = latent.shape
        compressed, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(compressed).view(batch, seq, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        keys = torch.cat([k_nope.transpose(1, 2), self.rope_key(k_pe, k_nope.shape[2]).transpose(1, 2)], dim=-1)
        return keys.transpose(1, 2), v  # [batch, seq, heads, qk_head_dim] of [batch, heads, seq, ...] memory

    def init_weights(self, init: ShardInit, out_std: float) -> None:
        """Projections std 0.02, the output projection the block's depth-scaled std, norms 1
        (torchtitan's DeepSeek-V3 init)."""
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                init.trunc_normal(getattr(self, name).weight, std=0.02)
        for name in ("q_norm", "kv_norm"):
            if hasattr(self, name):
                init.ones(getattr(self, name).weight)
        init.trunc_normal(self.wo.weight, std=out_std)
