"""The tensor-parallel plan of the shared decoder (models/decoder.py), Megatron-style: what every
family's plan shares, so no family imports another's.

q/k/v and w1/w3 by columns (whole heads / hidden units per rank), wo and w2 by rows, the embedding
and the head by vocab; the residual stream sequence-sharded or replicated (`sequence_parallel`).
A family with its own attention or feed-forward lays out the edges with `apply_edges` and its
blocks with `norms_plan`, its own entries and `feed_forward_plan` (or `attention_plan`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titanlite.parallel import tensor_parallel as tp


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """The edges (`apply_edges`), then each block's norms, GQA attention and SwiGLU over `tp_mesh`."""
    sp = sequence_parallel
    apply_edges(model, tp_mesh, loss_parallel, sp)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {**norms_plan(sp), **attention_plan(sp), **feed_forward_plan(sp)})


def apply_edges(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """The embedding and the head sharded by vocab, the final norm on the residual layout.

    A pipeline stage holds some of the blocks and the embedding or head only where it has them.
    With tied embeddings both modules shard the one table by vocab rows (Shard(0)), but each
    style swaps in its own DTensor parameter, so the tie is restored on the embedding's.
    """
    sp = sequence_parallel
    edges = {
        "tok_embeddings": tp.vocab_sharded_embedding(sp),
        "norm": tp.norm(sp),
        "output": tp.output_projection(loss_parallel, sp),
    }
    parallelize_module(model, tp_mesh, tp.present(model, edges))
    if model.args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.sequence_shards = tp_mesh.size() if sp else 1


def norms_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A block's two norms (decoder.DecoderBlock), on the residual layout."""
    return {"attention_norm": tp.norm(sequence_parallel), "ffn_norm": tp.norm(sequence_parallel)}


def attention_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A block's GQA attention (decoder.Attention): q/k/v by columns, wo by rows."""
    sp = sequence_parallel
    return {
        "attention": tp.block_entry(sp, extra_inputs=2),  # (x, cos_sin, mask)
        "attention.wq": tp.ColwiseParallel(),
        "attention.wk": tp.ColwiseParallel(),
        "attention.wv": tp.ColwiseParallel(),
        "attention.wo": tp.rowwise_exit(sp),
    }


def feed_forward_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A block's SwiGLU (decoder.FeedForward): w1/w3 by columns, w2 by rows."""
    sp = sequence_parallel
    return {
        "feed_forward": tp.block_entry(sp),
        "feed_forward.w1": tp.ColwiseParallel(),
        "feed_forward.w2": tp.rowwise_exit(sp),
        "feed_forward.w3": tp.ColwiseParallel(),
    }


def indivisible(sizes: dict[str, int], tp_degree: int) -> list[str]:
    """One message per size that does not split `tp_degree` ways (a family's tp_problems)."""
    return [
        f"{name} {size} is not divisible by tensor_parallel_degree {tp_degree}"
        for name, size in sizes.items()
        if size % tp_degree
    ]
