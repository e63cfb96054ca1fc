"""One attention kernel call that also returns its log-sum-exp, forward and backward, per device.

Chunked attention (models/chunked_attention.py) computes a query chunk's attention in pieces
of keys and merges them by their log-sum-exps (LSE). SDPA's public function returns no LSE,
so this calls the kernels under it, the ones torch's own ring attention calls
(torch.distributed.tensor.experimental._attention): each returns the LSE, and each has a
backward that takes the *final* output and LSE of all pieces merged, which makes each piece's
gradients exact without differentiating through the merge.

- CPU: `_scaled_dot_product_flash_attention_for_cpu` (GQA in place: fewer kv heads are read
  as they are; a mask must be additive, in the query's dtype).
- CUDA: `_scaled_dot_product_flash_attention` for fp16/bf16 pieces without a mask (GQA in
  place, as F.scaled_dot_product_attention's flash path); otherwise the memory-efficient
  kernel, which takes a float32 input and an additive bias but no GQA, so kv heads are
  repeated for it and their gradients summed back; its LSE is padded to a multiple of 32
  queries, which the merge slices off and the backward pads back. Meta tensors take this
  path too (torch registers these kernels' shapes), which is how CPU-only CI checks it.

Tensors are [batch, heads, seq, head_dim]; the LSE is float32 [batch, heads, queries]. The
kernels want one head dim for q, k and v; a value head dim unlike the key's (DeepSeek-V3's
MLA) is padded with zeros to the wider of the two first (`common_head_dim`): zero columns of
q and k add nothing to a score, zero columns of v give zero output columns, sliced off.
`scale` is the softmax scale, given explicitly (the padded head dim would change the default).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten

Saved = tuple[Any, ...]  # what one kernel's backward needs besides q, k, v, out and LSE


def common_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v padded with zeros to one head dim, the wider of q/k's and v's (unchanged,
    no copy, when they agree). Differentiable: the padding's gradient is dropped."""
    qk, width = q.shape[-1], v.shape[-1]
    if qk == width:
        return q, k, v
    if qk < width:
        return F.pad(q, (0, width - qk)), F.pad(k, (0, width - qk)), v
    return q, k, F.pad(v, (0, qk - width))


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, Saved]:
    """Attention of q over k, v of one head dim (top-left causal when `causal`, plus `bias`
    when given, scores times `scale`): the output, its LSE, and what `backward` needs."""
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse, (bias,)
    if bias is None and q.dtype in (torch.float16, torch.bfloat16):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse, ("flash", cum_q, cum_k, max_q, max_k, seed, offset)
    groups = q.shape[1] // k.shape[1]
    k, v = (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)) if groups > 1 else (k, v)
    bias = None if bias is None else _aligned(bias).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]], ("efficient", bias, seed, offset, lse.shape[-1], groups)


def backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    saved: Saved,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v for one piece, given the merged `out` and `lse` of its query rows."""
    if q.device.type == "cpu":
        (bias,) = saved
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if saved[0] == "flash":
        _, cum_q, cum_k, max_q, max_k, seed, offset = saved
        return aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    _, bias, seed, offset, width, groups = saved
    kv_heads = k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    lse = F.pad(lse, (0, width - lse.shape[-1])).contiguous()
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    if groups > 1:
        dk, dv = (g.unflatten(1, (kv_heads, groups)).sum(2) for g in (dk, dv))
    return dq, dk, dv


def _aligned(bias: torch.Tensor) -> torch.Tensor:
    """The bias in memory whose rows start 16-byte aligned, as the memory-efficient kernel
    requires (F.scaled_dot_product_attention pads the same way): a wider buffer, sliced; the
    heads stay a broadcast (stride 0) dim."""
    keys = bias.shape[-1]
    width = -(-keys // 16) * 16
    padded = bias.new_zeros((*bias.shape[:-1], width))
    padded[..., :keys] = bias
    return padded[..., :keys]
