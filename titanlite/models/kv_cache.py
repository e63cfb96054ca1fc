"""A key/value cache for incremental decoding: each new token's forward computes its own keys
and values only and attends over those of every earlier token, kept here.

Opt-in, for generation only (`python -m titanlite.generate`): a model that supports it takes
one `KVCache` in `enable_kv_cache`, hands each attention layer its own `LayerKVCache`, and
reads the new tokens' positions and mask from the cache. Training never creates one; its
forward only checks that none is set (an attribute test per layer, nothing computed).

All rows of a batch share one position: the cache holds `length` tokens of every row, the
next forward's tokens sit at positions length, length + 1, ..., and the caller `advance`s
the cache after each forward. (Generation feeds prompts of different lengths by giving the
longer ones their own tokens at the first decoding steps, so no row is ever padded.)

The buffers are allocated at the first forward, from the keys that layer computes: their
batch size, dtype, device and head count, which under tensor parallelism is this rank's
share of the heads.
"""

from __future__ import annotations

import torch

from titanlite.models.attention import build_mask


class KVCache:
    """The position shared by every layer's cache, and up to `max_len` tokens per row."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0  # tokens of each row already held

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """The positions of a forward's `seq` new tokens: right after the cached ones."""
        if self.length + seq > self.max_len:
            raise ValueError(f"KVCache: {self.length} + {seq} tokens exceed its max_len {self.max_len}")
        return torch.arange(self.length, self.length + seq, device=device)

    def mask(self, seq: int, device: torch.device, window: int | None = None) -> torch.Tensor | None:
        """The causal mask of `seq` new queries over every cached key and the new ones (within
        a sliding `window` when given: the cache keeps every key, the mask drops the old ones):
        a boolean SDPA mask, or None while the cache is empty and no window applies (a
        prompt's first forward is plain causal attention, SDPA's fast path). Never flex
        attention: its compiled kernel would recompile for every new key length."""
        if self.length == 0 and window is None:
            return None
        keys = torch.arange(self.length + seq, device=device)
        return build_mask("causal", None, self.positions(seq, device), keys, flex=False, window=window)

    def advance(self, seq: int) -> None:
        """Count the `seq` tokens the last forward wrote into every layer."""
        self.length += seq


class LayerKVCache:
    """One attention layer's keys and values: [batch, max_len, kv_heads, head_dim] each (the
    values' head dim their own: DeepSeek-V3's MLA has values narrower than its keys)."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values ([batch, seq, kv_heads, head_dim], after
        RoPE) at the cache's position; return every token's so far (views, no copy)."""
        if self.keys is None:
            self.keys = k.new_zeros((k.shape[0], self.cache.max_len, *k.shape[2:]))
            self.values = v.new_zeros((v.shape[0], self.cache.max_len, *v.shape[2:]))
        start, stop = self.cache.length, self.cache.length + k.shape[1]
        self.keys[:, start:stop] = k
        self.values[:, start:stop] = v
        return self.keys[:, :stop], self.values[:, :stop]
