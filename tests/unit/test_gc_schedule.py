"""`training.gc_freq`: the collector runs at the same steps on every rank, and only then (`ScheduledGC`,
a step participant: `resume` starts the schedule, `close` ends it)."""

from __future__ import annotations

import gc

import pytest

from titanlite.config import load_config
from titanlite.runtime.gc_schedule import COLLECTED_GENERATION, ScheduledGC


@pytest.fixture
def collections():
    """The generation of every collection while the test runs."""
    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)
    gc.enable()


def test_the_loop_collects_every_gc_freq_steps_with_automatic_collection_off(collections):
    start = len(collections)  # pytest's own work may have triggered automatic ones before
    collector = ScheduledGC(every=3)
    collector.resume(0)
    assert not gc.isenabled()
    assert collections[start:] == [COLLECTED_GENERATION]  # one before the first step
    per_step = []
    for step in range(1, 8):
        before = len(collections)
        garbage = [[] for _ in range(5000)]  # enough new objects to pass any automatic threshold
        del garbage
        collector.after_step(step, last=step == 7)
        per_step.append(len(collections) - before)
    during_loop = collections[start:]
    collector.close()
    assert per_step == [0, 0, 1, 0, 0, 1, 0]
    assert during_loop == [COLLECTED_GENERATION] * 3
    assert gc.isenabled()  # automatic collection is back after the loop


def test_gc_freq_zero_leaves_python_automatic_collection_alone(collections):
    collector = ScheduledGC(every=0)
    collector.resume(0)
    assert gc.isenabled()
    before = len(collections)
    collector.after_step(50, last=False)
    assert len(collections) == before
    collector.close()
    assert gc.isenabled()


def test_a_caller_that_turned_collection_off_finds_it_off_after_the_loop(collections):
    gc.disable()
    collector = ScheduledGC(every=2)
    collector.resume(0)
    collector.after_step(2, last=False)
    collector.close()
    assert not gc.isenabled()


def test_gc_freq_is_a_training_option_with_torchtitans_default():
    assert load_config(["--config", "debug_model"]).training.gc_freq == 50
    assert load_config(["--config", "debug_model", "--training.gc_freq", "0"]).training.gc_freq == 0
