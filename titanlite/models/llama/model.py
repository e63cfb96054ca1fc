"""Llama 2/3: the shared decoder (models/decoder.py) as it is, with interleaved RoPE pairs
(Meta's reference weights; models/rope.py, with Llama 3.1 scaling), GQA, SwiGLU, RMSNorm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlite.model_spec import DecoderArgs
from titanlite.models.decoder import Decoder, DecoderBlock
from titanlite.models.rope import Llama31Scaling


@dataclass(frozen=True)
class LlamaArgs(DecoderArgs):
    """Hyperparameters of one Llama flavor; `vocab_size` is replaced by the tokenizer's. head_dim
    is dim / n_heads (DecoderArgs' default)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1 frequency scaling: None (off) or (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings).
    rope_scaling: Llama31Scaling | None = None
    max_seq_len: int = 8192
    # Scale the init of each block's output projections by its depth (torchtitan's default).
    depth_init: bool = True
    # One table for the token embedding and the output head (Llama 3.2 1B and 3B do this).
    tie_word_embeddings: bool = False
    # "causal" or "block_causal" (each token sees only its own document): models/attention.py.
    attn_mask_type: str = "causal"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, scaled, rounded up to `multiple_of` (Meta's rule)."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


class TransformerBlock(DecoderBlock):
    """Llama's block: the shared pre-norm block with GQA attention and SwiGLU, as it is (its own
    class name, which `fsdp_shard_modules` and the other unit selectors name)."""


class Llama(Decoder):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]: the shared decoder over Llama's
    blocks, RoPE over head_dim with Llama 3.1 scaling when set."""

    block_class = TransformerBlock
