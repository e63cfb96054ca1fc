"""Attention of query chunks over the whole window's keys, without a dense mask.

Under context parallelism (parallel/context_parallel.py) a rank holds a few equal chunks of
the window's queries, each at a known global start, and every key and value of the window in
order. A dense mask over [queries, keys] would make the CPU kernel add it to every score
(and, for "causal", be built where none is needed). Instead, per query chunk starting at s:

- keys before s (whole past chunks): one call, no mask;
- keys s .. s + chunk: one call with the kernel's own causal rule (the diagonal block);
- keys after the chunk: never computed;

and the partial results merged by their log-sum-exps (models/attention_lse.py gives each
call's). Under "block_causal" the keys before the start of the chunk's earliest document
are dropped too, and a chunk whose keys all belong to one document per sequence (the usual
case when documents are longer than a chunk) is computed as above; only a chunk that crosses
a document boundary, or whose sequences' documents start at different places, gets a mask,
and only over its own keys (one call, so no row is ever fully masked).

The plan (which keys, which kernel, which mask) depends only on the chunk starts and the
document ids, so the model makes it once per forward and every layer reuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from titanlite.models import attention_lse


@dataclass(frozen=True)
class Piece:
    """One kernel call: keys [start, stop) of the window, the kernel's causal rule (queries
    and keys starting at the same position) or none, and an additive mask
    [batch or 1, 1, queries, keys] where the rule is neither."""

    start: int
    stop: int
    causal: bool = False
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class QueryChunk:
    """Local query rows [first, first + length) and the pieces of keys they attend to."""

    first: int
    length: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class ChunkPlan:
    """What `chunked_attention` computes for each of this rank's query chunks."""

    chunks: tuple[QueryChunk, ...]


def plan_chunks(
    mask_type: str, document_ids: torch.Tensor | None, starts: Sequence[int], chunk_len: int, dtype: torch.dtype
) -> ChunkPlan:
    """The plan for local queries made of chunks of `chunk_len` tokens at global `starts` (in
    local order), under "causal" or "block_causal" (document_ids [batch, window], whose ids
    count up along the window as the loader numbers them; other ids get a mask per chunk,
    still exact). Masks are made in `dtype`, the queries' (the CPU kernel wants it)."""
    if mask_type == "block_causal" and document_ids is None:
        raise ValueError("block_causal attention needs the windows' document ids")
    documents = _Documents(document_ids) if mask_type == "block_causal" else None
    chunks = []
    for i, start in enumerate(starts):
        pieces = _causal_pieces(0, start, chunk_len) if documents is None else documents.pieces(start, chunk_len, dtype)
        chunks.append(QueryChunk(i * chunk_len, chunk_len, pieces))
    return ChunkPlan(tuple(chunks))


def _causal_pieces(first_key: int, start: int, chunk_len: int) -> tuple[Piece, ...]:
    """Keys [first_key, start) unmasked, then the diagonal block under the causal rule."""
    past = (Piece(first_key, start),) if first_key < start else ()
    return (*past, Piece(start, start + chunk_len, causal=True))


class _Documents:
    """The decisions block_causal needs, read once per forward on the host."""

    def __init__(self, document_ids: torch.Tensor):
        self.ids = document_ids
        host = document_ids.cpu()
        self.counts_up = bool((host[:, 1:] >= host[:, :-1]).all())
        boundary = torch.ones_like(host, dtype=torch.bool)
        boundary[:, 1:] = host[:, 1:] != host[:, :-1]
        positions = torch.arange(host.shape[1]).expand_as(host)
        self.doc_start = torch.where(boundary, positions, 0).cummax(dim=1).values  # where each token's document starts
        self.host = host

    def pieces(self, start: int, chunk_len: int, dtype: torch.dtype) -> tuple[Piece, ...]:
        stop = start + chunk_len
        if not self.counts_up:  # ids that repeat apart: no shortcut, the rule over every earlier key
            return (self._masked(0, start, stop, dtype),)
        first = self.doc_start[:, start]
        lo = int(first.min())  # no query of the chunk sees a key before its earliest document
        one_document = bool((first == lo).all()) and bool((self.host[:, stop - 1] == self.host[:, start]).all())
        return _causal_pieces(lo, start, chunk_len) if one_document else (self._masked(lo, start, stop, dtype),)

    def _masked(self, lo: int, start: int, stop: int, dtype: torch.dtype) -> Piece:
        """Queries [start, stop) over keys [lo, stop) under the block-causal rule, as an additive mask."""
        device = self.ids.device
        queries, keys = torch.arange(start, stop, device=device), torch.arange(lo, stop, device=device)
        allowed = (queries[:, None] >= keys[None, :]) & (self.ids[:, start:stop, None] == self.ids[:, None, lo:stop])
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        return Piece(lo, stop, bias=bias[:, None])


def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ChunkPlan, scale: float | None = None
) -> torch.Tensor:
    """q [batch, heads, local queries, head_dim] over the window's k, v [batch, kv_heads, window,
    head_dim] (GQA when kv_heads < heads; v's head dim may differ from q's and k's) as `plan`
    says, scores times `scale` (None: q's head_dim ** -0.5); the output [batch, heads, queries,
    v head_dim] is laid out like [batch, queries, heads, v head_dim] memory, so merging the
    heads afterwards is a view."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ChunkedAttention.apply(q, k, v, plan, scale)


class _ChunkedAttention(torch.autograd.Function):
    """Forward: each piece's output and LSE, merged per query chunk. Backward: each piece's
    kernel backward with the merged output and LSE of its rows (exact, as in ring attention),
    gradients summed over the pieces in float32. q, k, v are padded to one head dim for the
    kernels (attention_lse.common_head_dim) once, outside the pieces."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ChunkPlan, scale: float) -> torch.Tensor:
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        q, k, v = attention_lse.common_head_dim(q, k, v)
        batch, heads, queries, head_dim = q.shape
        out = q.new_empty(batch, queries, heads, head_dim).transpose(1, 2)
        lse = q.new_empty(batch, heads, queries, dtype=torch.float32)
        saved = []
        for chunk in plan.chunks:
            rows = slice(chunk.first, chunk.first + chunk.length)
            merged_out = merged_lse = None
            for piece in chunk.pieces:
                keys = slice(piece.start, piece.stop)
                part, part_lse, state = attention_lse.forward(
                    q[:, :, rows], k[:, :, keys], v[:, :, keys], piece.causal, piece.bias, scale
                )
                saved.append(state)
                merged_out, merged_lse = _merge(merged_out, merged_lse, part, part_lse)
            out[:, :, rows] = merged_out
            lse[:, :, rows] = merged_lse
        ctx.plan, ctx.states, ctx.scale, ctx.dims = plan, saved, scale, (qk_dim, v_dim)
        ctx.save_for_backward(q, k, v, out, lse)
        return out[..., :v_dim]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        qk_dim, v_dim = ctx.dims
        if v_dim < out.shape[-1]:  # the padded output columns are zero and take no gradient
            grad = torch.nn.functional.pad(grad, (0, out.shape[-1] - v_dim))
        dq, dk, dv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
        states = iter(ctx.states)
        for chunk in ctx.plan.chunks:
            rows = slice(chunk.first, chunk.first + chunk.length)
            rows_lse = lse[:, :, rows].contiguous()
            for piece in chunk.pieces:
                keys = slice(piece.start, piece.stop)
                d_q, d_k, d_v = attention_lse.backward(
                    grad[:, :, rows],
                    q[:, :, rows],
                    k[:, :, keys],
                    v[:, :, keys],
                    out[:, :, rows],
                    rows_lse,
                    piece.causal,
                    next(states),
                    ctx.scale,
                )
                dq[:, :, rows] += d_q
                dk[:, :, keys] += d_k
                dv[:, :, keys] += d_v
        dq, dk, dv = dq[..., :qk_dim], dk[..., :qk_dim], dv[..., :v_dim]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the union of two key sets from each set's output and LSE (in float32)."""
    if out is None:
        return part, part_lse
    merged = torch.logaddexp(lse, part_lse)
    out = out.float() * (lse - merged).exp_().unsqueeze(-1) + part.float() * (part_lse - merged).exp_().unsqueeze(-1)
    return out, merged
