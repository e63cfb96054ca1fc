"""Context parallelism: each training window's sequence split over the "cp" mesh dim.

The Llama 3 paper's all-gather method: every cp rank holds a part of the sequence for every
layer; attention all-gathers the keys and values over cp (with autograd: the backward is the
matching reduce-scatter) and attends its own queries to all of them under the causal (and,
with documents, block-causal) mask at global positions. Everything else in a block is
per-token and runs on the local part unchanged; RoPE rotates at global positions; the loss
is each rank's mean over its tokens, averaged over cp with the dp ranks (FSDP shards and
reduces over dp_shard x cp, and the logged loss is averaged over both).

Load balancing: the window's tokens are cut into 2 x cp chunks and cp rank r holds chunks r
and 2cp-1-r. Under a causal mask a query's work grows with its position, so pairing an early
chunk with a late one gives every rank the same attention work (torchtitan's "head-tail").
The gather puts the keys back in window order (one copy of k and v per layer), so a query
chunk's earlier keys are one slice: attention runs per chunk without a dense mask
(models/chunked_attention.py), from each rank's `chunk_starts`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def chunk_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Global positions of cp rank `cp_rank`'s tokens: chunks r and 2cp-1-r of 2cp."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(start, start + chunk) for start in chunk_starts(seq_len, cp_rank, cp)])


def chunk_starts(seq_len: int, cp_rank: int, cp: int) -> list[int]:
    """Global starts of cp rank `cp_rank`'s two chunks, in its local order."""
    chunk = seq_len // (2 * cp)
    return [cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk]


def _copy_chunks(window: torch.Tensor, ranks: torch.Tensor, cp: int, into_window: bool) -> None:
    """Copy between `window` (dim 0 in window order: chunks 0 .. 2cp-1; any strides) and
    `ranks` (dim 0 in rank order: [cp x (chunk r, chunk 2cp-1-r)]): into `window` when
    `into_window`, else the inverse, into `ranks`."""
    pairs, halves = ranks.unflatten(0, (cp, 2, -1)), window.unflatten(0, (2, cp, -1))
    for in_window, in_ranks in [(halves[0], pairs[:, 0])] + [(halves[1, cp - 1 - r], pairs[r, 1]) for r in range(cp)]:
        into, source = (in_window, in_ranks) if into_window else (in_ranks, in_window)
        into.copy_(source)


def _empty_in_memory_order(shape: list[int], memory_order: tuple[int, ...] | None, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor of `shape` whose dims lie in memory in `memory_order`
    (outermost first; None: row-major)."""
    if memory_order is None:
        return like.new_empty(shape)
    inverse = sorted(range(len(memory_order)), key=memory_order.__getitem__)
    return like.new_empty([shape[d] for d in memory_order]).permute(inverse)


class ContextParallel:
    """This rank's place on the cp dim, and the sequence operations attention needs."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's `local_len` tokens."""
        return chunk_positions(local_len * self.size, self.rank, self.size).to(device)

    def chunk_starts(self, local_len: int) -> list[int]:
        """Global starts of this rank's two chunks of `local_len` / 2 tokens each."""
        return chunk_starts(local_len * self.size, self.rank, self.size)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (inputs, labels), along `dim`."""
        return x.index_select(dim, chunk_positions(x.shape[dim], self.rank, self.size).to(x.device))

    def gather(
        self, parts: tuple[torch.Tensor, ...], dim: int, memory_order: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The whole window of each of `parts` (same shapes) along `dim`, in window order,
        from every rank's part, in one collective; each result laid out in memory in
        `memory_order` (e.g. keys [batch, seq, heads, head_dim] as (0, 2, 1, 3): every head's
        keys contiguous, as the attention kernels read them). Gradients reduce-scatter back."""
        return _GatherAlong.apply(dim, self.mesh.get_group(), memory_order, *parts)


@runtime_checkable
class ContextParallelModel(Protocol):
    """What context parallelism needs from a model (the registry's models declare it as
    `ModelSpec.capabilities.context_parallel`): to be handed this rank's `ContextParallel`,
    after which its attention gathers every cp rank's keys and values, rotates at global
    positions (`positions`) and attends per chunk (`chunk_starts`)."""

    def enable_context_parallel(self, context_parallel: ContextParallel) -> None: ...


# torch 2.13 names them *_single (the *_tensor names warn as deprecated); torch 2.11 has only these.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _stacked_buffer(tensors: tuple[torch.Tensor, ...], dim: int) -> torch.Tensor:
    """An uninitialized buffer for same-shaped `tensors` side by side, `dim` first: [dim, i, rest]."""
    first = tensors[0].movedim(dim, 0)
    return first.new_empty((first.shape[0], len(tensors), *first.shape[1:]))


class _GatherAlong(torch.autograd.Function):
    """All-gather of several same-shaped tensors along a dim into window order, whose backward
    reduce-scatters (sums) the gradients back to each rank's part: torch's own collectives in
    an autograd.Function. (torch 2.13's `all_gather_tensor_autograd` with gather_dim=1 on a
    [batch, seq, heads, head_dim] key returned a tensor that does not require grad, so wk and
    wv silently got no gradient; gather_dim=0 keeps the graph. Checked on gloo, see
    TORCH_NOTES.) One copy each way besides the collective's: the parts into one send buffer
    (dim first), and the gathered rows into each result, reordered and laid out as asked."""

    @staticmethod
    def forward(ctx, dim: int, group: dist.ProcessGroup, memory_order: tuple[int, ...] | None, *parts: torch.Tensor):
        ctx.dim, ctx.group = dim, group
        cp = dist.get_world_size(group)
        front = _stacked_buffer(parts, dim)
        for i, part in enumerate(parts):
            front[:, i] = part.movedim(dim, 0)
        gathered = front.new_empty((front.shape[0] * cp, *front.shape[1:]))
        _all_gather(gathered, front, group=group)
        shape = list(parts[0].shape)
        shape[dim] *= cp
        results = tuple(_empty_in_memory_order(shape, memory_order, part) for part in parts)
        for i, result in enumerate(results):
            _copy_chunks(result.movedim(dim, 0), gathered[:, i], cp, into_window=True)
        return results

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # autograd hands zeros for an unused output, never None
        cp = dist.get_world_size(ctx.group)
        front = _stacked_buffer(grads, ctx.dim)
        for i, grad in enumerate(grads):
            _copy_chunks(grad.movedim(ctx.dim, 0), front[:, i], cp, into_window=False)
        out = front.new_empty((front.shape[0] // cp, *front.shape[1:]))
        _reduce_scatter(out, front, group=ctx.group)
        return (None, None, None, *(out[:, i].movedim(0, ctx.dim) for i in range(len(grads))))
