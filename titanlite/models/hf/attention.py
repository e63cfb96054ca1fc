"""Context parallelism for a transformers model: an attention function registered with
transformers' `AttentionInterface`, which attends this rank's queries to every cp rank's keys
and values with titanlite's chunked attention (parallel/context_parallel.py,
models/chunked_attention.py), as the native families' attention does.

The model's forward hands it, as keyword arguments transformers passes down to attention,
the rank's `ContextParallel` and the forward's `ChunkPlan`; the tokens' global positions go
in as `position_ids`, so RoPE rotates each at its place in the window. transformers builds no
mask for a function it has no mask maker for, and none is needed: the plan is the mask.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.errors import TitanliteError
from titanlite.models.chunked_attention import ChunkPlan, chunked_attention
from titanlite.parallel.context_parallel import ContextParallel

CP_ATTENTION = "titanlite_context_parallel"


def register_cp_attention() -> str:
    """The name `config._attn_implementation` takes under context parallelism."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention)
    return CP_ATTENTION


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    context_parallel: ContextParallel | None = None,
    chunk_plan: ChunkPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [batch, heads, local seq, head_dim], key and value [batch, kv_heads, local seq,
    head_dim] -> output [batch, local seq, heads, head_dim] over the whole window's keys."""
    key, value = context_parallel.gather((key, value), dim=2)
    if sliding_window is not None and sliding_window < key.shape[2]:
        raise TitanliteError(
            f"parallelism.context_parallel_degree: {type(module).__name__} attends a sliding window"
            f" of {sliding_window} tokens, which context-parallel attention does not (the window is {key.shape[2]})"
        )
    if softcap or (dropout and module.training):
        raise TitanliteError(
            f"parallelism.context_parallel_degree: {type(module).__name__} caps or drops attention scores"
        )
    return chunked_attention(query, key, value, chunk_plan, scaling).transpose(1, 2), None
