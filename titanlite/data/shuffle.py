"""A keyed pseudo-random permutation of [0, n) in O(1) memory: the per-epoch shuffle.

A corpus can hold 10^10 windows, so an explicit shuffled index (8 bytes a window) is out
of the question. A Feistel network is a bijection on [0, 2^b) for any round function; b
is the smallest even bit count covering n, and cycle walking (apply it again while the
result is >= n) restricts it to a bijection on [0, n). Since 2^b < 4n, a lookup takes
under 4 network evaluations on average. The round function is splitmix64's finalizer
keyed per round, so the order depends on the key (seed, dataset, epoch) and nothing else. A new epoch's
permutation costs three hashes to set up.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
ROUNDS = 4  # Luby-Rackoff: 4 rounds of a pseudo-random function make a strong permutation


def mix64(x: int) -> int:
    """splitmix64's finalizer: a fast, well-mixing bijection on 64-bit ints."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive_key(*parts: int) -> int:
    """One 64-bit key from several non-negative ints (seed, dataset, epoch, round)."""
    key = 0x9E3779B97F4A7C15
    for part in parts:
        key = mix64((key ^ part) & MASK64)
    return key


class FeistelPermutation:
    """`perm(i)` for i in [0, n): a bijection of [0, n) chosen by `key`."""

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"permutation of an empty range (n={n})")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        # distinct per round; the round function mixes them, so no hashing is needed here
        self.round_keys = [(key + r * 0x9E3779B97F4A7C15) & MASK64 for r in range(ROUNDS)]

    def _network(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for round_key in self.round_keys:
            left, right = right, left ^ (mix64(right ^ round_key) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} outside [0, {self.n})")
        x = self._network(i)
        while x >= self.n:
            x = self._network(x)
        return x
