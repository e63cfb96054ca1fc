"""models/chunked_attention.py on one process: every cp rank's chunks attended over the whole
window equal the dense-mask attention's rows, forward and backward, at cp 2 and 4, causal and
block-causal; the plan uses no mask where no chunk crosses a document boundary and drops keys
before a chunk's documents; the gather's window order inverts the rank order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanlite.models.attention import attend, build_mask
from titanlite.models.chunked_attention import ChunkPlan, Piece, QueryChunk, chunked_attention, plan_chunks
from titanlite.parallel.context_parallel import _copy_chunks, chunk_positions, chunk_starts

SEQ = 64


def documents(seq: int) -> torch.Tensor:
    """Row 0: boundaries inside chunks and at a chunk edge (cp 4: chunks of 8); row 1: one
    long document, then a short one, so the two rows' documents start at different places."""
    row0 = torch.zeros(seq, dtype=torch.int32)
    for start in (5, 16, 29, 30, 47):
        row0[start:] += 1
    row1 = torch.zeros(seq, dtype=torch.int32)
    row1[40:] = 1
    return torch.stack([row0, row1])


def dense_and_chunked(mask_type: str, cp: int, docs: torch.Tensor | None):
    """Outputs and q, k, v gradients of the dense-mask attention over the whole window and of
    each rank's chunks (its rows of q, every key), summed over the ranks."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, SEQ, 16, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(2, 2, SEQ, 16).requires_grad_()  # GQA: 2 kv heads for 4 query heads
    v = torch.randn(2, 2, SEQ, 16).requires_grad_()
    weights = torch.randn(2, 4, SEQ, 16)
    positions = torch.arange(SEQ)
    mask = build_mask(mask_type, docs, positions, positions, flex=False)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    (dense * weights).sum().backward()
    dense_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    outs = []
    for rank in range(cp):
        rows = chunk_positions(SEQ, rank, cp)
        plan = plan_chunks(mask_type, docs, chunk_starts(SEQ, rank, cp), SEQ // (2 * cp), torch.float32)
        out = attend(q[:, :, rows], k, v, plan, grouped=True)
        (out * weights[:, :, rows]).sum().backward()
        outs.append((rows, out.detach()))
    return dense.detach(), dense_grads, outs, [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
def test_each_ranks_chunks_equal_the_dense_mask_attention(mask_type, cp):
    docs = documents(SEQ) if mask_type == "block_causal" else None
    dense, dense_grads, outs, grads = dense_and_chunked(mask_type, cp, docs)
    for rows, out in outs:
        torch.testing.assert_close(out, dense[:, :, rows], rtol=1e-5, atol=1e-5)
    for grad, expected in zip(grads, dense_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


def test_document_ids_that_repeat_apart_still_get_the_exact_rule():
    docs = documents(SEQ)
    docs[0, 50:] = 0  # the first document's id again, after others: no shortcut applies
    dense, dense_grads, outs, grads = dense_and_chunked("block_causal", 2, docs)
    for rows, out in outs:
        torch.testing.assert_close(out, dense[:, :, rows], rtol=1e-5, atol=1e-5)
    for grad, expected in zip(grads, dense_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


def test_the_plan_masks_only_chunks_that_cross_a_document_boundary():
    causal = plan_chunks("causal", None, chunk_starts(SEQ, 1, 2), 16, torch.float32)
    # Rank 1 of cp 2 holds chunks 1 (keys 16-31) and 2 (32-47): the past unmasked, the diagonal causal.
    assert [[(p.start, p.stop, p.causal, p.bias is None) for p in c.pieces] for c in causal.chunks] == [
        [(0, 16, False, True), (16, 32, True, True)],
        [(0, 32, False, True), (32, 48, True, True)],
    ]
    docs = torch.zeros(1, SEQ, dtype=torch.int32)
    docs[0, 16:] = 1  # a document starts at chunk 1's first token; chunk 2 lies inside it
    block = plan_chunks("block_causal", docs, chunk_starts(SEQ, 1, 2), 16, torch.float32)
    assert [[(p.start, p.stop, p.causal, p.bias is None) for p in c.pieces] for c in block.chunks] == [
        [(16, 32, True, True)],
        [(16, 32, False, True), (32, 48, True, True)],
    ]
    docs[0, 40:] = 2  # now chunk 2 crosses a boundary: one masked call over keys 16-47 only
    (crossing,) = plan_chunks("block_causal", docs, chunk_starts(SEQ, 1, 2), 16, torch.float32).chunks[1].pieces
    assert (crossing.start, crossing.stop, crossing.bias.shape) == (16, 48, (1, 1, 16, 32))


@pytest.mark.parametrize("cp", [2, 4])
def test_the_gathers_window_order_inverts_the_rank_order(cp):
    rank_order = torch.cat([chunk_positions(SEQ, rank, cp) for rank in range(cp)])
    window, ranks = torch.empty(SEQ, dtype=torch.long), torch.empty(SEQ, dtype=torch.long)
    _copy_chunks(window, rank_order, cp, into_window=True)
    _copy_chunks(torch.arange(SEQ), ranks, cp, into_window=False)
    assert torch.equal(window, torch.arange(SEQ)) and torch.equal(ranks, rank_order)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cuda_kernels_shapes_on_meta_tensors(dtype):
    """The CUDA path (flash for bf16 pieces, memory-efficient for float32 and masked ones, kv
    heads repeated for it) run on meta tensors, whose shapes torch registers for those kernels:
    the output and every gradient come back in their inputs' shapes."""
    q = torch.empty(2, 4, 40, 16, device="meta", dtype=dtype, requires_grad=True)
    k = torch.empty(2, 2, 80, 16, device="meta", dtype=dtype, requires_grad=True)
    v = torch.empty(2, 2, 80, 16, device="meta", dtype=dtype, requires_grad=True)
    causal = plan_chunks("causal", None, [0, 60], 20, dtype)
    masked = ChunkPlan(
        (
            QueryChunk(0, 20, (Piece(0, 20, causal=True),)),
            QueryChunk(20, 20, (Piece(30, 80, bias=torch.zeros(2, 1, 20, 50, device="meta", dtype=dtype)),)),
        )
    )
    for plan in (causal, masked):
        out = chunked_attention(q, k, v, plan)
        assert out.shape == q.shape and out.dtype == dtype
        out.sum().backward()
        assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
