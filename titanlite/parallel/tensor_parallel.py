"""Building blocks for tensor-parallel plans with sequence parallelism.

A model's plan (e.g. `models/llama/parallelize.py`) is a dict for `parallelize_module`;
these helpers name the few layouts every Megatron-style plan repeats, so a plan reads as
"where activations are sequence-sharded and where they are replicated".

Activations between blocks are sharded on the sequence dimension (Shard(1)). Each
attention / MLP sub-module gathers them to Replicate on entry, runs colwise-then-rowwise
linears on local head / hidden shards, and reduce-scatters back to Shard(1) on exit.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "SequenceParallel",
    "embedding_to_sequence_shards",
    "gather_sequence_on_entry",
    "output_projection",
    "rowwise_to_sequence_shards",
]


def embedding_to_sequence_shards() -> RowwiseParallel:
    """Vocab-sharded embedding table whose output leaves sharded on the sequence."""
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))


def gather_sequence_on_entry(extra_inputs: int = 0) -> PrepareModuleInput:
    """All-gather a sequence-sharded first input to Replicate; pass `extra_inputs` through."""
    passthrough = (None,) * extra_inputs
    return PrepareModuleInput(
        input_layouts=(Shard(1), *passthrough),
        desired_input_layouts=(Replicate(), *passthrough),
    )


def rowwise_to_sequence_shards() -> RowwiseParallel:
    """Rowwise linear whose partial sums are reduce-scattered onto sequence shards."""
    return RowwiseParallel(output_layouts=Shard(1))


def output_projection(loss_parallel: bool) -> ColwiseParallel:
    """Vocab-sharded output head. With loss parallel the logits stay a vocab-sharded
    DTensor (never gathered); the loss must then run under `loss_parallel()`."""
    return ColwiseParallel(
        input_layouts=Shard(1),
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
