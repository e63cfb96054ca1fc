"""The decoder every family builds on: SwiGLU feed-forward, GQA attention, the pre-norm block and
the embedding -> blocks -> norm -> head model around them, with context parallelism, the KV cache
and pipeline stages handled once.

The layout follows Meta's reference weights (`wq/wk/wv/wo`, `w1/w2/w3`, `attention_norm`,
`ffn_norm`), so tensor-parallel plans and Hugging Face mappings can name modules directly. Head
counts are read from the weights at run time (`view(..., -1, head_dim)`), so the same code runs
with the full model or with the local shard a TP plan leaves.

A family specializes it in three places: its attention (subclass `Attention` and override
`rotate`, e.g. Qwen3's QK norms, or bring its own module with `context_parallel` and `kv_cache`
attributes, e.g. DeepSeek-V3's MLA), its block (`DecoderBlock.make_attention` /
`make_feed_forward`), and its model (`Decoder.block_class`, `Decoder.rope_table`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.attention import Mask, attend, build_mask
from titanlite.models.chunked_attention import plan_chunks
from titanlite.models.init import ShardInit
from titanlite.models.kv_cache import KVCache, LayerKVCache
from titanlite.parallel.placement import local_tensor
from titanlite.model_spec import DecoderArgs
from titanlite.models.rope import RopeScaling, apply_rope, rope_cos_sin
from titanlite.parallel.context_parallel import ContextParallel

# The parameters of the shared decoder that train without weight decay (ModelSpec.no_decay):
# the embedding table and every RMSNorm's weight; it has no biases.
NO_DECAY = ("tok_embeddings.*", "*norm.weight")


class DecoderModelArgs(DecoderArgs, Protocol):
    """What the shared decoder reads of a family's args beyond `DecoderArgs`: every family's
    args dataclass has these fields."""

    norm_eps: float  # the RMSNorms' eps
    rope_theta: float
    depth_init: bool  # each block's output projections' init std scaled by its depth, else by n_layers

    @property
    def rope_scaling(self) -> RopeScaling:
        """Llama 3.1 scaling, YaRN, or None (models/rope.py)."""


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init: ShardInit, out_std: float) -> None:
        init.trunc_normal(self.w1.weight, std=0.02)
        for linear in (self.w2, self.w3):
            init.trunc_normal(linear.weight, std=out_std)


class Attention(nn.Module):
    """Grouped-query attention over args.n_heads query heads and args.kv_heads key/value heads
    of args.head_dim, RoPE'd by `rotate` (interleaved pairs unless a family overrides it).
    `bias` gives the four projections biases; a family with attention sinks (gpt-oss) sets
    `sinks` to a parameter of one logit per head, which `attend` adds to each softmax's
    denominator."""

    def __init__(self, args: DecoderModelArgs, bias: bool = False):
        super().__init__()
        self.head_dim = args.head_dim
        self.grouped = args.kv_heads != args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        self.sinks: nn.Parameter | None = None
        self.context_parallel: ContextParallel | None = None  # set by Decoder.enable_context_parallel
        self.kv_cache: LayerKVCache | None = None  # set by Decoder.enable_kv_cache (generation only)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = [w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv)]
        q, k = self.rotate(q, k, cos_sin)
        if self.context_parallel is not None:  # every cp rank's keys and values, in one collective,
            k, v = self.context_parallel.gather((k, v), dim=1, memory_order=(0, 2, 1, 3))  # each head's contiguous
        elif self.kv_cache is not None:  # generation: every earlier token's keys and values too
            k, v = self.kv_cache.extend(k, v)
        # GQA inside the kernel: each kv head serves n_heads / kv_heads query heads (also true
        # of a TP shard), read in place instead of copied by repeat_interleave. The transposes
        # are views; the CPU and CUDA kernels take strided heads, and the output's
        # [batch, seq, heads, head_dim] memory makes the reshape below a view too.
        sinks = None if self.sinks is None else local_tensor(self.sinks)  # this rank's heads' under TP
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.grouped, sinks=sinks)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k at their positions: interleaved RoPE. A family whose attention differs only
        here (Qwen3: a norm per head, then RoPE in the half layout) overrides it."""
        return apply_rope(q, cos_sin), apply_rope(k, cos_sin)

    def init_weights(self, init: ShardInit, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal(linear.weight, std=0.02)
        init.trunc_normal(self.wo.weight, std=out_std)


class DecoderBlock(nn.Module):
    """Pre-norm attention and feed-forward with residuals. A family changes the attention or the
    feed-forward by overriding `make_attention` / `make_feed_forward`; each sub-module brings
    its own `init_weights(init, out_std)`."""

    def __init__(self, layer_id: int, args: DecoderModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = self.make_attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = self.make_feed_forward(layer_id, args)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_proj_std = 0.02 / (2 * depth) ** 0.5

    def make_attention(self, args: DecoderModelArgs) -> nn.Module:
        return Attention(args)

    def make_feed_forward(self, layer_id: int, args: DecoderModelArgs) -> nn.Module:
        return FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos_sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, init: ShardInit) -> None:
        """Norms 1, first projections std 0.02, output projections the depth-scaled std
        (each sub-module's own `init_weights`; values are keyed by name, not by order)."""
        init.ones(self.attention_norm.weight)
        self.attention.init_weights(init, self.out_proj_std)
        init.ones(self.ffn_norm.weight)
        self.feed_forward.init_weights(init, self.out_proj_std)


class Decoder(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]: embedding, `block_class` blocks,
    final norm, head (optionally tied to the embedding), RoPE table from `rope_table`."""

    block_class: type[nn.Module] = DecoderBlock
    # Whether a CUDA forward attends with flex_attention's BlockMask; False for attention sinks,
    # which need the kernels that return a log-sum-exp (models/attention.attend).
    flex_masks: bool = True

    def __init__(self, args: DecoderModelArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(f"{type(args).__name__}.vocab_size must be set from the tokenizer")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."n-1" keeps parameter names stable when blocks are
        # wrapped (activation checkpointing, compile) and lets plans address blocks by name.
        self.layers = nn.ModuleDict({str(i): self.block_class(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", self.rope_table(args, "meta"), persistent=False)
        self.context_parallel: ContextParallel | None = None
        self.kv_cache: KVCache | None = None
        # Sequence shards of the activations between blocks: tp under sequence parallelism
        # (set by the TP plan), so a stage's input tells the local sequence length.
        self.sequence_shards = 1

    @staticmethod
    def rope_table(args: DecoderModelArgs, device: torch.device | str) -> torch.Tensor:
        """The complex RoPE table [max_seq_len, rotary_dim/2] the blocks' attention rotates by:
        over args.head_dim with args.rope_theta and args.rope_scaling. A family whose attention
        rotates another width or scales otherwise (DeepSeek-V3: qk_rope_head_dim, YaRN)
        overrides it."""
        return rope_cos_sin(args, device)

    def enable_context_parallel(self, context_parallel: ContextParallel) -> None:
        """Context parallelism (parallel/context_parallel.py): this rank's tokens sit at global
        positions, attention gathers every rank's keys and values, and a feed-forward with a
        `context_parallel` attribute (the MoE layer: its aux loss's token counts) sums over the
        cp ranks. Each module is reached through its own attribute, so any attention class works."""
        self.context_parallel = context_parallel
        for block in self.layers.values():
            block.attention.context_parallel = context_parallel
            if hasattr(block.feed_forward, "context_parallel"):
                block.feed_forward.context_parallel = context_parallel

    def enable_kv_cache(self, cache: KVCache | None) -> None:
        """Incremental decoding (models/kv_cache.py): each forward's tokens follow the cached
        ones, and each attention layer keeps its keys and values in its own share of `cache`.
        None turns it off again. Generation only; a pipeline stage caches its own blocks."""
        self.kv_cache = cache
        for block in self.layers.values():
            block.attention.kv_cache = LayerKVCache(cache) if cache is not None else None

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] (or, on a pipeline stage after the first, the previous stage's
        activations); document_ids [batch, window] with block_causal attention. A pipeline
        stage holds None for the modules of other stages (parallel/pipeline.py)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = tokens.shape[1] if self.tok_embeddings is not None else h.shape[1] * self.sequence_shards
        cos_sin, masks = self.attention_inputs(seq, h, document_ids)
        for name, block in self.layers.items():
            h = block(h, cos_sin, masks[name])
        return self.head(h)

    def attention_inputs(
        self, seq: int, h: torch.Tensor, document_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, Mask]]:
        """The RoPE rows of this forward's `seq` positions (h: their activations) and each block's
        mask, by block name (one mask per distinct sliding window)."""
        if self.kv_cache is not None:  # generation: these tokens follow the cached ones
            cos_sin = self.rope_cache[self.kv_cache.positions(seq, h.device)]
        elif self.context_parallel is not None:  # this rank's two chunks, attended per chunk
            cos_sin = self.rope_cache[self.context_parallel.positions(seq, h.device)]
        else:
            cos_sin = self.rope_cache[:seq]
        windows = {name: self.args.sliding_window(int(name)) for name in self.layers}
        masks = {window: self._mask(seq, document_ids, h, window) for window in set(windows.values())}
        return cos_sin, {name: masks[window] for name, window in windows.items()}

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the output head, where this stage has them."""
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def _mask(self, seq: int, document_ids: torch.Tensor | None, h: torch.Tensor, window: int | None) -> Mask:
        """The mask of the blocks with this sliding window (None: none): the KV cache's, this
        cp rank's chunk plan, the window's chunks, or the whole sequence's."""
        if self.kv_cache is not None:
            return self.kv_cache.mask(seq, h.device, window)
        if (cp := self.context_parallel) is not None:
            starts = cp.chunk_starts(seq)
            return plan_chunks(self.args.attn_mask_type, document_ids, starts, seq // 2, h.dtype, window, h.device)
        if window is not None and seq > window and seq % window == 0:  # chunks of `window` queries, each
            starts = range(0, seq, window)  # over the keys its window reaches: O(seq x window), not seq^2
            return plan_chunks(self.args.attn_mask_type, document_ids, starts, window, h.dtype, window, h.device)
        positions = None if window is None else torch.arange(seq, device=h.device)
        flex = h.is_cuda and self.flex_masks
        return build_mask(self.args.attn_mask_type, document_ids, positions, positions, flex=flex, window=window)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill this rank's shard of every parameter, with the values of the same elements in
        any other parallel layout (see models/init.py)."""
        if self.args.tie_word_embeddings:
            # `to_empty` gives each module a new Parameter for a plain tensor (DTensor ones
            # are swapped in place and stay shared): tie again before filling the table.
            self.output.weight = self.tok_embeddings.weight
        self.rope_cache = self.rope_table(self.args, next(self.parameters()).device)
        init = ShardInit(self, seed)
        if self.tok_embeddings is not None and not self.args.tie_word_embeddings:
            init.normal(self.tok_embeddings.weight, std=1.0)
        for block in self.layers.values():
            block.init_weights(init)
        if self.norm is not None:
            init.ones(self.norm.weight)
        if self.output is not None:
            # A tied table takes the head's init (std dim^-0.5): at the embedding's std 1 the
            # first logits would be sqrt(dim) times too large.
            cutoff = 3 * self.args.dim**-0.5
            init.trunc_normal(self.output.weight, std=self.args.dim**-0.5, a=-cutoff, b=cutoff)
