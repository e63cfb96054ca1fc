"""Profiler traces of chosen steps (one Chrome trace per rank, with the step's forward,
backward and collectives), CUDA memory snapshots, and nothing at all when both are off."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerAction

from titanlite.config import JobConfig
from titanlite.observe import profiling
from titanlite.observe.profiling import maybe_profile

CUDA_ONLY_LINE = "profiling.enable_memory_snapshot: memory snapshots are CUDA-only"


def config(tmp_path: Path, **profiling_options) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    for key, value in profiling_options.items():
        setattr(cfg.profiling, key, value)
    return cfg


def steps_doing(action: ProfilerAction, freq: int, start_step: int, last_step: int) -> list[int]:
    """Trainer steps whose schedule action is `action` (trainer step start+n+1 is the
    profiler's step n), asked a few steps past the end as the profiler does."""
    schedule = profiling._trace_schedule(freq, start_step, last_step)
    return [start_step + n + 1 for n in range(last_step - start_step + 3) if schedule(n) == action]


def test_traced_steps_are_multiples_of_profile_freq_after_a_resume_too():
    record = ProfilerAction.RECORD_AND_SAVE
    assert steps_doing(record, freq=3, start_step=0, last_step=10) == [3, 6, 9]
    assert steps_doing(record, freq=3, start_step=4, last_step=12) == [6, 9, 12]
    assert steps_doing(record, freq=1, start_step=0, last_step=3) == [1, 2, 3]
    # the step before each traced one warms up; nothing starts after the last step
    assert steps_doing(ProfilerAction.WARMUP, freq=2, start_step=0, last_step=5) == [1, 3, 5]
    assert steps_doing(ProfilerAction.NONE, freq=2, start_step=0, last_step=5) == [6, 7, 8]


def test_off_starts_nothing(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a profiler was started with profiling off")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refuse)
    with maybe_profile(config(tmp_path), rank=0, device=torch.device("cuda")) as stepper:
        for _ in range(3):
            stepper.step()
    assert list(tmp_path.iterdir()) == []


def test_memory_snapshot_on_cpu_says_once_it_is_cuda_only(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("titanlite"), "propagate", True)
    cfg = config(tmp_path, enable_memory_snapshot=True, profile_freq=1)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        for rank in (0, 1):  # every rank runs this; rank 0 speaks
            with maybe_profile(cfg, rank, torch.device("cpu")) as stepper:
                stepper.step()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(CUDA_ONLY_LINE) and "this run is on cpu" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_memory_snapshots_dump_on_schedule_and_on_oom(tmp_path, monkeypatch):
    """The CUDA path's schedule, file names and OOM dump, with the two CUDA allocator calls
    replaced by ones that record what they were asked (this machine has no GPU; a GPU run
    checks the pickles themselves)."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))

    def dump(path):
        calls.append(("dump", Path(path).relative_to(tmp_path).as_posix()))
        Path(path).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    cfg = config(tmp_path, enable_memory_snapshot=True, profile_freq=2)
    with pytest.raises(torch.OutOfMemoryError):
        with maybe_profile(cfg, rank=3, device=torch.device("cuda"), start_step=10) as stepper:
            for _ in range(3):  # steps 11, 12, 13
                stepper.step()
            raise torch.OutOfMemoryError("CUDA out of memory")  # in step 14
    assert calls == [
        ("record", {"max_entries": profiling.MEMORY_HISTORY_ENTRIES}),
        ("dump", "memory_snapshot/iteration_12/rank3_memory_snapshot.pickle"),
        ("dump", "memory_snapshot/iteration_14_oom/rank3_memory_snapshot.pickle"),
        ("record", {"enabled": None}),
    ]
