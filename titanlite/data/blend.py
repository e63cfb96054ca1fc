"""Blending several datasets by weight, as a pure function of the global window index.

The global window stream interleaves the datasets in a fixed pattern of PERIOD slots:
dataset d gets `counts[d]` slots of each period (its weight's share of PERIOD, rounded so
the counts sum to PERIOD), spread by smooth weighted round robin so that any prefix of the
pattern is within one window of its target share. Window g then belongs to dataset
`pattern[g % PERIOD]` and is that dataset's window number
`(g // PERIOD) * counts[d] + offset[g % PERIOD]`: O(1) time and O(PERIOD) memory for any
g, no state beyond g itself, so resuming (at any dp degree) needs only g.
"""

from __future__ import annotations

PERIOD = 4096


def slot_counts(weights: list[float]) -> list[int]:
    """Each weight's share of PERIOD slots, largest remainders rounded up (sum = PERIOD)."""
    total = sum(weights)
    exact = [w / total * PERIOD for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda d: (counts[d] - exact[d], d))
    for d in by_remainder[: PERIOD - sum(counts)]:
        counts[d] += 1
    return counts


class BlendPattern:
    """Which dataset, and which of its windows, global window g is."""

    def __init__(self, weights: list[float]) -> None:
        if not weights or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"blend weights must be >= 0 with a positive sum (got {weights})")
        self.counts = slot_counts(weights)
        self.dataset_of: list[int] = []
        self.offset_in: list[int] = []
        assigned = [0] * len(weights)
        for slot in range(PERIOD):
            # the dataset furthest behind its share of the slots so far
            d = max(range(len(weights)), key=lambda i: (self.counts[i] * (slot + 1) - assigned[i] * PERIOD, -i))
            self.dataset_of.append(d)
            self.offset_in.append(assigned[d])
            assigned[d] += 1

    def locate(self, g: int) -> tuple[int, int]:
        """(dataset, that dataset's window number) of global window g."""
        block, slot = divmod(g, PERIOD)
        d = self.dataset_of[slot]
        return d, block * self.counts[d] + self.offset_in[slot]
