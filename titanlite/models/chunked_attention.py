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

A sliding window (gpt-oss) drops the keys before the window of the chunk's first query; when
it cuts into the chunk's keys, the chunk is one call with a mask over the keys it keeps.

Attention sinks (gpt-oss: a learned logit per head in every row's softmax denominator) are one
more piece whose output is zero and whose log-sum-exp is the sink: merged like the others,
they scale each row by sigmoid(lse - sink). The kernels' backward given the merged output
and LSE is then exact for q, k and v, and the sink's own gradient is
-sum over rows of exp(sink - lse) * rowsum(grad * out).

The plan (which keys, which kernel, which mask) depends only on the chunk starts, the
document ids and the window, so the model makes it once per forward and every layer with that
window reuses it.
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
    mask_type: str,
    document_ids: torch.Tensor | None,
    starts: Sequence[int],
    chunk_len: int,
    dtype: torch.dtype,
    window: int | None = None,
    device: torch.device | str = "cpu",
) -> ChunkPlan:
    """The plan for local queries made of chunks of `chunk_len` tokens at global `starts` (in
    local order), under "causal" or "block_causal" (document_ids [batch, window], whose ids
    count up along the window as the loader numbers them; other ids get a mask per chunk,
    still exact), within a sliding `window` when given. Masks are made in `dtype`, the
    queries' (the CPU kernel wants it), on `device` (the ids' when there are ids)."""
    if mask_type == "block_causal" and document_ids is None:
        raise ValueError("block_causal attention needs the windows' document ids")
    documents = _Documents(document_ids) if mask_type == "block_causal" else None
    ids = documents.ids if documents is not None else None
    chunks = []
    for i, start in enumerate(starts):
        stop = start + chunk_len
        lo, plain = (0, True) if documents is None else documents.span(start, stop)
        if window is not None and stop - 1 - lo >= window:  # the window cuts into the keys
            lo, plain = max(lo, start - window + 1), False
        masked = () if plain else (_masked(ids, lo, start, stop, dtype, window, device),)
        pieces = masked or _causal_pieces(lo, start, chunk_len)
        chunks.append(QueryChunk(i * chunk_len, chunk_len, pieces))
    return ChunkPlan(tuple(chunks))


def whole_plan(mask: torch.Tensor | None, queries: int, keys: int, dtype: torch.dtype) -> ChunkPlan:
    """A whole-sequence mask as a plan of one chunk: None (causal, queries == keys) the
    kernel's causal rule, a boolean [batch or 1, 1, queries, keys] mask an additive one."""
    if mask is None:
        return ChunkPlan((QueryChunk(0, queries, (Piece(0, keys, causal=True),)),))
    return ChunkPlan((QueryChunk(0, queries, (Piece(0, keys, bias=additive(mask, dtype)),)),))


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the kernels add it to the scores: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _causal_pieces(first_key: int, start: int, chunk_len: int) -> tuple[Piece, ...]:
    """Keys [first_key, start) unmasked, then the diagonal block under the causal rule."""
    past = (Piece(first_key, start),) if first_key < start else ()
    return (*past, Piece(start, start + chunk_len, causal=True))


def _masked(
    ids: torch.Tensor | None, lo: int, start: int, stop: int, dtype: torch.dtype, window: int | None, device
) -> Piece:
    """Queries [start, stop) over keys [lo, stop) under the causal rule, within the window and
    the documents when given, as an additive mask."""
    device = ids.device if ids is not None else device
    queries, keys = torch.arange(start, stop, device=device), torch.arange(lo, stop, device=device)
    allowed = queries[:, None] >= keys[None, :]
    if window is not None:
        allowed = allowed & (queries[:, None] - keys[None, :] < window)
    allowed = allowed[None] if ids is None else allowed & (ids[:, start:stop, None] == ids[:, None, lo:stop])
    return Piece(lo, stop, bias=additive(allowed, dtype)[:, None])


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

    def span(self, start: int, stop: int) -> tuple[int, bool]:
        """The first key any query of [start, stop) sees, and whether every sequence's chunk
        lies in one document starting there (the causal pieces suffice; else a mask)."""
        if not self.counts_up:  # ids that repeat apart: no shortcut, the rule over every earlier key
            return 0, False
        first = self.doc_start[:, start]
        lo = int(first.min())  # no query of the chunk sees a key before its earliest document
        one_document = bool((first == lo).all()) and bool((self.host[:, stop - 1] == self.host[:, start]).all())
        return lo, one_document


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ChunkPlan,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [batch, heads, local queries, head_dim] over the window's k, v [batch, kv_heads, window,
    head_dim] (GQA when kv_heads < heads; v's head dim may differ from q's and k's) as `plan`
    says, scores times `scale` (None: q's head_dim ** -0.5); the output [batch, heads, queries,
    v head_dim] is laid out like [batch, queries, heads, v head_dim] memory, so merging the
    heads afterwards is a view. `sinks` [heads]: each head's sink logit (see the module docstring)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ChunkedAttention.apply(q, k, v, plan, scale, sinks)


class _ChunkedAttention(torch.autograd.Function):
    """Forward: each piece's output and LSE, merged per query chunk. Backward: each piece's
    kernel backward with the merged output and LSE of its rows (exact, as in ring attention),
    gradients summed over the pieces in float32 (float64 for float64 pieces). q, k, v are padded to one head dim for the
    kernels (attention_lse.common_head_dim) once, outside the pieces."""

    @staticmethod
    def forward(ctx, q, k, v, plan: ChunkPlan, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        q, k, v = attention_lse.common_head_dim(q, k, v)
        batch, heads, queries, head_dim = q.shape
        out = q.new_empty(batch, queries, heads, head_dim).transpose(1, 2)
        wide = torch.promote_types(q.dtype, torch.float32)  # the kernels' LSE dtype, and the merge's
        lse = q.new_empty(batch, heads, queries, dtype=wide)
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
            if sinks is not None:  # a piece of zero output whose LSE is the sink
                total = torch.logaddexp(merged_lse, sinks.to(wide).view(1, -1, 1))
                merged_out, merged_lse = merged_out.to(wide) * (merged_lse - total).exp_().unsqueeze(-1), total
            out[:, :, rows] = merged_out
            lse[:, :, rows] = merged_lse
        ctx.plan, ctx.states, ctx.scale, ctx.dims = plan, saved, scale, (qk_dim, v_dim)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out[..., :v_dim]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        qk_dim, v_dim = ctx.dims
        if v_dim < out.shape[-1]:  # the padded output columns are zero and take no gradient
            grad = torch.nn.functional.pad(grad, (0, out.shape[-1] - v_dim))
        wide = lse.dtype
        dq, dk, dv = [torch.zeros(t.shape, dtype=wide, device=t.device) for t in (q, k, v)]
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
        d_sinks = None
        if sinks is not None:  # -sum over rows of p(sink) * rowsum(grad * out)
            sink_share = (sinks.to(wide).view(1, -1, 1) - lse).exp()
            d_sinks = -(sink_share * (grad.to(wide) * out.to(wide)).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, d_sinks


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the union of two key sets from each set's output and LSE (in float32, or
    float64 for float64 pieces)."""
    if out is None:
        return part, part_lse
    merged, wide = torch.logaddexp(lse, part_lse), lse.dtype
    out = out.to(wide) * (lse - merged).exp_().unsqueeze(-1) + part.to(wide) * (part_lse - merged).exp_().unsqueeze(-1)
    return out, merged
