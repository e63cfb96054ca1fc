"""titanlite/data/shuffle.py: the Feistel permutation visits every index once, follows its key and
holds no table."""

from __future__ import annotations

import numpy as np
import pytest

from titanlite.data.shuffle import FeistelPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 64, 65, 1000, 4097])
def test_feistel_is_a_permutation(n):
    perm = FeistelPermutation(n, key=12345)
    assert sorted(perm(i) for i in range(n)) == list(range(n))


def test_feistel_depends_on_the_key_and_needs_no_table():
    a, b = FeistelPermutation(1000, 1), FeistelPermutation(1000, 2)
    order_a = [a(i) for i in range(1000)]
    assert order_a == [FeistelPermutation(1000, 1)(i) for i in range(1000)]  # deterministic
    assert order_a != [b(i) for i in range(1000)] and order_a != list(range(1000))
    huge = FeistelPermutation(10**10, 3)  # 10^10 windows: a few ints of state
    assert all(0 <= huge(i) < 10**10 for i in range(0, 10**10, 10**8))
    assert not any(isinstance(v, (list, np.ndarray)) and len(v) > 8 for v in vars(huge).values())
