"""titanlite/data/windows.py: each epoch visits every window of a dataset once, in a new order."""

from __future__ import annotations

from tests.helpers.token_data import SEQ, VOCAB, shards  # noqa: F401 (fixtures)
from titanlite.data.windows import DatasetWindows


def test_each_epoch_visits_every_window_once_in_a_new_order(shards):
    windows = DatasetWindows(shards, SEQ + 1, 0, 200, seed=7)
    epoch0 = [windows.index(k) for k in range(200)]
    epoch1 = [windows.index(k) for k in range(200, 400)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(200))
    assert epoch0 != epoch1
    unshuffled = DatasetWindows(shards, SEQ + 1, 0, 200, seed=None)
    assert [unshuffled.index(k) for k in range(400)] == list(range(200)) * 2
    assert windows.tokens(5)[0] == windows.index(5) * 16 % VOCAB
