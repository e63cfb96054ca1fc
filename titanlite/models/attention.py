"""Attention under a causal or a block-causal (document) mask, for every model of the registry.

`model.attn_mask_type` (torchtitan's names):

- "causal": a token attends to every earlier token of the window, across the documents
  packed into it (SDPA's `is_causal`, the fast path, when the whole sequence is local);
- "block_causal": a token attends only to earlier tokens of its own document, as Llama 3 was
  pretrained. The loader hands each window's document ids (`data/loader.py`).

A sliding window (gpt-oss's alternate layers) narrows either rule further: a query at position
p sees keys at p - window + 1 .. p only (transformers' `sliding_window`). It is a mask, not a
kernel of its own. Attention sinks (gpt-oss: one learned logit per head in the softmax's
denominator) need each row's log-sum-exp, so attention with sinks always runs through the
chunked kernels (models/chunked_attention.py), a whole-sequence mask as one chunk.

Under context parallelism (parallel/context_parallel.py) the local queries are chunks of the
window at global positions and the keys are the whole window's: attention runs per chunk
without a dense mask (models/chunked_attention.py, a `ChunkPlan` in place of the mask).
`build_mask` also takes positions, for queries that follow cached keys (models/kv_cache.py).
Positions and RoPE stay the window's: a document that starts mid-window keeps its
window positions, as in torchtitan and Meta's reference (block masking changes what a token
sees, not where it is).

One mask, two kernels, chosen by device: on CPU a boolean mask for SDPA; on CUDA a
`flex_attention` BlockMask (compiled, sparse: blocks outside every document are skipped,
which is what makes long packed windows affordable). Both compute the same attention.
"""

from __future__ import annotations

import functools
from typing import Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titanlite.models.chunked_attention import ChunkPlan, additive, chunked_attention, whole_plan

Mask = Union[torch.Tensor, BlockMask, ChunkPlan, None]


def build_mask(
    mask_type: str,
    document_ids: torch.Tensor | None,
    q_positions: torch.Tensor | None,
    k_positions: torch.Tensor | None,
    flex: bool,
    window: int | None = None,
) -> Mask:
    """The mask of a forward: None for plain causal attention over a local whole sequence,
    else a boolean [batch or 1, 1, queries, keys] tensor (SDPA) or a BlockMask (`flex`).

    document_ids: [batch, seq_len] over the whole window (block_causal only); positions: the
    global positions of the local queries and of the keys (None: the whole window, in order);
    window: the sliding window's width in tokens (None: unlimited).
    """
    if mask_type == "causal" and q_positions is None and window is None:
        return None
    if mask_type == "block_causal" and document_ids is None:
        raise ValueError("block_causal attention needs the windows' document ids")
    seq_len = document_ids.shape[1] if document_ids is not None else int(k_positions.numel())
    device = document_ids.device if document_ids is not None else q_positions.device
    if q_positions is None:
        q_positions = k_positions = torch.arange(seq_len, device=device)
    docs = document_ids if mask_type == "block_causal" else None
    if flex:
        return _block_mask(docs, q_positions, k_positions, window)
    allowed = q_positions[:, None] >= k_positions[None, :]
    if window is not None:
        allowed = allowed & (q_positions[:, None] - k_positions[None, :] < window)
    if docs is not None:
        allowed = allowed & (docs[:, q_positions, None] == docs[:, None, k_positions])
    return allowed[None, None] if allowed.dim() == 2 else allowed[:, None]


def _block_mask(
    docs: torch.Tensor | None, q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None
) -> BlockMask:
    """The same rule as a flex_attention mask_mod, over query and key indices."""

    def causal(b, h, q, k):
        return q_positions[q] >= k_positions[k]

    def windowed(b, h, q, k):
        return causal(b, h, q, k) & (q_positions[q] - k_positions[k] < window)

    rule = causal if window is None else windowed

    def block_causal(b, h, q, k):
        return rule(b, h, q, k) & (docs[b, q_positions[q]] == docs[b, k_positions[k]])

    batch, mask_mod = (None, rule) if docs is None else (docs.shape[0], block_causal)
    make = _compiled(create_block_mask) if q_positions.is_cuda else create_block_mask
    return make(mask_mod, batch, None, len(q_positions), len(k_positions), device=q_positions.device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    grouped: bool,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [batch, heads, queries, head_dim] over k, v [batch, kv_heads, keys,
    head_dim] (GQA when `grouped`; v's head dim may differ, as in DeepSeek-V3's MLA), scores
    times `scale` (None: head_dim ** -0.5): SDPA causal, SDPA with a boolean mask, flex, or
    per chunk. `sinks` [heads]: a logit per head added to each row's softmax denominator
    (gpt-oss), computed per chunk whatever the mask (a BlockMask is refused)."""
    if sinks is not None and not isinstance(mask, ChunkPlan):
        if isinstance(mask, BlockMask):
            raise ValueError("attention sinks need a boolean mask or a chunk plan, not a flex BlockMask")
        mask = whole_plan(mask, q.shape[2], k.shape[2], q.dtype)
    if isinstance(mask, ChunkPlan):
        return chunked_attention(q, k, v, mask, scale, sinks)
    if isinstance(mask, BlockMask):
        # Compiled flex_attention on CUDA (torchtitan's use; eager flex is a slow reference);
        # eager elsewhere, which unit tests use to check the kernel against SDPA.
        flex = _compiled(flex_attention) if q.is_cuda else flex_attention
        return flex(q, k, v, block_mask=mask, enable_gqa=grouped, scale=scale)
    return _sdpa(q, k, v, mask, grouped, scale)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, grouped: bool, scale: float | None
) -> torch.Tensor:
    """SDPA, causal when `mask` is None, else under the boolean mask.

    On CPU, a value head dim unlike the key's (MLA: 128 against 192) rules out torch's fused
    CPU kernel, which wants one head dim for q, k and v; SDPA's math path then scores every
    query against every key, the causal half masked away. Causal attention there runs instead
    as `_CausalByQueryBlocks`. On CUDA nothing changes: flash refuses unequal dims too, but
    cuDNN (sm90+, 192/128 forward and backward) and the memory-efficient kernel take them.
    """
    whole_causal_on_cpu = mask is None and q.device.type == "cpu" and q.shape[-2] == k.shape[-2] and not grouped
    if whole_causal_on_cpu and v.shape[-1] != q.shape[-1]:
        return _CausalByQueryBlocks.apply(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=grouped, scale=scale
    )


CAUSAL_QUERY_BLOCK = 128


def _causal_rule(start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
    """Queries start..stop over keys 0..stop: 0 where a key is at or before the query, else -inf."""
    allowed = torch.arange(start, stop, device=like.device)[:, None] >= torch.arange(stop, device=like.device)
    return additive(allowed, like.dtype)


class _CausalByQueryBlocks(torch.autograd.Function):
    """Causal attention as batched matmuls, `CAUSAL_QUERY_BLOCK` queries at a time over the keys
    up to the block's last query: keys after it are never scored, so a sequence of n blocks
    costs (n + 1) / 2n of the score and value products that SDPA's math path computes. Each
    block's scores come from one `baddbmm` that adds the causal rule and the scale within the
    product. The backward is written out, as flash attention's is, from each block's saved
    probabilities: the key and value gradients accumulate in place over the blocks, where
    autograd would zero-fill and add a whole gradient per block slice. q, k, v [batch, heads,
    seq, head_dim] (v's head dim its own) -> [batch, heads, seq, v head_dim], laid out as
    [batch, seq, heads, v head_dim] memory so that merging the heads is a view. MLA's training
    step on CPU: docs/performance.md (issue 50)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        batch, heads, seq, _ = q.shape
        q, k, v = (t.reshape(batch * heads, seq, t.shape[-1]) for t in (q, k, v))
        out = v.new_empty(batch, seq, heads, v.shape[-1])
        probs = []
        for start in range(0, seq, CAUSAL_QUERY_BLOCK):
            stop = min(start + CAUSAL_QUERY_BLOCK, seq)
            scores = torch.baddbmm(_causal_rule(start, stop, q), q[:, start:stop], k[:, :stop].mT, alpha=scale)
            probs.append(scores.softmax(-1, dtype=torch.promote_types(q.dtype, torch.float32)))
            block = torch.bmm(probs[-1].to(v.dtype), v[:, :stop])
            out[:, start:stop] = block.view(batch, heads, stop - start, -1).transpose(1, 2)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scale = scale
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, *probs = ctx.saved_tensors
        shape = grad.shape[:2]
        grad = grad.reshape(q.shape[0], q.shape[1], -1)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for start, p in zip(range(0, q.shape[1], CAUSAL_QUERY_BLOCK), probs):
            stop, g = start + p.shape[1], grad[:, start : start + p.shape[1]]
            dv[:, :stop].baddbmm_(p.to(v.dtype).mT, g)
            d_probs = torch.bmm(g, v[:, :stop].mT).to(p.dtype)
            d_scores = torch._softmax_backward_data(d_probs, p, -1, p.dtype).mul_(ctx.scale).to(q.dtype)
            torch.bmm(d_scores, k[:, :stop], out=dq[:, start:stop])
            dk[:, :stop].baddbmm_(d_scores.mT, q[:, start:stop])
        return *(t.view(*shape, *t.shape[1:]) for t in (dq, dk, dv)), None


@functools.cache
def _compiled(function):
    """`function` compiled, once per process (flex_attention, create_block_mask on CUDA)."""
    return torch.compile(function)
