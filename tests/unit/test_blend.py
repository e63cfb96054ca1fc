"""titanlite/data/blend.py: blend weights hold within 1% and each dataset's windows are visited once,
in order. (The blend's syntax in training.dataset_path: test_load.py.)"""

from __future__ import annotations

from collections import Counter

import pytest

from titanlite.data.blend import BlendPattern


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.25], [0.99, 0.01], [3, 0, 1]])
def test_blend_weights_hold_within_1_percent_over_10000_windows(weights):
    pattern = BlendPattern(weights)
    for start in (0, 123_457):
        counts = Counter(pattern.locate(g)[0] for g in range(start, start + 10_000))
        for d, w in enumerate(weights):
            assert abs(counts[d] / 10_000 - w / sum(weights)) < 0.01, (weights, counts)


def test_blend_visits_each_dataset_window_once_in_order():
    pattern = BlendPattern([0.6, 0.4])
    seen = {0: [], 1: []}
    for g in range(20_000):
        d, k = pattern.locate(g)
        seen[d].append(k)
    assert all(ks == list(range(len(ks))) for ks in seen.values())
