"""Start-up progress lines: what, how far, time left, throttled."""

import logging

from titanlite.observe import progress
from titanlite.observe.progress import Progress


def test_line_says_what_how_far_and_time_left(monkeypatch):
    clock = iter([100.0, 110.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    p = Progress("preparing data", total=4e9, unit="B")
    p.done = 1e9
    assert p.line() == "preparing data: 25% (1.0 GB of 4.0 GB), 10 s elapsed, about 30 s left"


def test_unknown_total_gives_amount_and_rate(monkeypatch):
    clock = iter([0.0, 4.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    p = Progress("tokenizing", unit="tokens")
    p.done = 2000
    assert p.line() == "tokenizing: 2,000 tokens, 500 tokens/s, 4 s elapsed"


def test_updates_are_throttled_and_finish_always_logs(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    logger = logging.getLogger("titanlite")
    monkeypatch.setattr(logger, "propagate", True)
    p = Progress("loading", total=10, unit="files", every_s=5)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        for step in range(10):
            now[0] = step * 1.0
            p.advance()
        now[0] = 75.0
        p.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "loading: 60% (6 files of 10 files), 5 s elapsed, about 3 s left",
        "loading: done, 10 files in 1 min 15 s",
    ]
