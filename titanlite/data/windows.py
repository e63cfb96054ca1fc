"""Training windows as a pure function of their global index.

A prepared dataset's token stream is cut into consecutive, non-overlapping windows of
`seq_len + 1` tokens (the tail shorter than a window is never used). `DatasetWindows` is
the endless sequence of those in [lo, hi): epoch after epoch, each epoch in the order of a
keyed permutation (seed, dataset, epoch) or in stream order without a seed. `WindowStream`
blends several of them by weight. Window g of the stream is computed, never iterated to:
any rank reads exactly the windows it trains on, at a cost independent of the dp degree
and the corpus size.
"""

from __future__ import annotations

import numpy as np

from titanlite.data.blend import BlendPattern
from titanlite.data.token_shards import TokenShards
from titanlite.data.shuffle import FeistelPermutation, derive_key


def window_count(shards: TokenShards, window: int) -> int:
    return shards.num_tokens // window


class DatasetWindows:
    """Windows [lo, hi) of one prepared dataset, visited epoch by epoch."""

    def __init__(self, shards: TokenShards, window: int, lo: int, hi: int, seed: int | None, salt: int = 0) -> None:
        if not 0 <= lo < hi <= window_count(shards, window):
            raise ValueError(
                f"window range [{lo}, {hi}) outside the {window_count(shards, window)} windows of {shards.folder}"
            )
        self.shards, self.window, self.lo, self.hi = shards, window, lo, hi
        self.seed, self.salt = seed, salt
        self._epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.hi - self.lo

    def index(self, k: int) -> int:
        """The dataset window index of the k-th window visited (k >= 0, across epochs)."""
        epoch, position = divmod(k, len(self))
        if self.seed is None:
            return self.lo + position
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, FeistelPermutation(len(self), derive_key(self.seed, self.salt, epoch))
        return self.lo + self._perm(position)

    def tokens(self, k: int) -> np.ndarray:
        return self.shards.read(self.index(k) * self.window, self.window)

    def documents(self, k: int) -> np.ndarray:
        """Which document each token of window k belongs to, from 0 (see TokenShards.document_ids)."""
        return self.shards.document_ids(self.index(k) * self.window, self.window)

    def trained(self, k: int) -> np.ndarray:
        """Whether each token of window k is trained (see TokenShards.read_mask)."""
        return self.shards.read_mask(self.index(k) * self.window, self.window)


class WindowStream:
    """Several datasets' windows blended by weight (see blend.py); one dataset is the identity."""

    def __init__(self, parts: list[DatasetWindows], weights: list[float], name: str) -> None:
        self.parts, self.name = parts, name
        self.pattern = BlendPattern(weights) if len(parts) > 1 else None
        self.window = parts[0].window
        self.masked = any(part.shards.chat for part in parts)  # labels masked where a token is not trained

    def locate(self, g: int) -> tuple[int, int]:
        """(dataset, its k) of global window g."""
        return (0, g) if self.pattern is None else self.pattern.locate(g)

    def tokens(self, g: int) -> np.ndarray:
        d, k = self.locate(g)
        return self.parts[d].tokens(k)

    def documents(self, g: int) -> np.ndarray:
        d, k = self.locate(g)
        return self.parts[d].documents(k)

    def trained(self, g: int) -> np.ndarray:
        d, k = self.locate(g)
        return self.parts[d].trained(k)

    def __len__(self) -> int:
        """Windows in one pass over every part (for validation: how many there are)."""
        return sum(len(p) for p in self.parts)
