"""titanlite's attention inside a transformers model: a function registered with transformers'
`AttentionInterface`, used when titanlite's masks are needed (context parallelism, document
masking); otherwise the model keeps transformers' SDPA.

The model's forward hands it, as keyword arguments transformers passes down to attention, the
forward's mask (`models/attention.Mask`: a boolean document mask, a flex BlockMask, or under
context parallelism the `ChunkPlan`) and the rank's `ContextParallel`, whose gather gives every
cp rank's keys and values; the tokens' global positions go in as `position_ids`, so RoPE
rotates each at its place in the window. transformers builds no mask of its own for a function
it has no mask maker for. A sliding window shorter than the window, a score cap and attention
dropout are transformers' alone: they stop the first forward in one line.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.errors import TitanliteError
from titanlite.models.attention import Mask, attend
from titanlite.parallel.context_parallel import ContextParallel

ATTENTION = "titanlite"


def register_attention() -> str:
    """The name `config._attn_implementation` takes for titanlite's attention."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, titanlite_attention)
    return ATTENTION


def titanlite_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    titanlite_mask: Mask = None,
    context_parallel: ContextParallel | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [batch, heads, seq, head_dim], key and value [batch, kv_heads, seq, head_dim] ->
    output [batch, seq, heads, head_dim]; under context parallelism over the whole window's keys."""
    if context_parallel is not None:
        key, value = context_parallel.gather((key, value), dim=2)
    name = type(module).__name__
    if sliding_window is not None and sliding_window < key.shape[2]:
        raise TitanliteError(
            f"model.hf_assets_path: {name} attends a sliding window of {sliding_window} tokens, which titanlite's "
            f"context-parallel and document-masked attention do not (the window is {key.shape[2]})"
        )
    if softcap or (dropout and module.training):
        raise TitanliteError(f"model.hf_assets_path: {name} caps or drops attention scores, which titanlite's does not")
    out = attend(query, key, value, titanlite_mask, key.shape[1] != query.shape[1], scaling)
    return out.transpose(1, 2), None
