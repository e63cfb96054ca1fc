"""A rank stuck in its own code (spinning, deadlocked), told apart from the ranks waiting for it.

When a rank stops making progress outside any collective, its peers' collectives time out
and each of them says so; none of them can say which rank they waited for. A stopped
process (SIGSTOP) the launcher sees in /proc; a running one looks like its waiting peers
there. So each worker under `titanlite.launch` watches its own main thread from a daemon
thread (`watch_main_thread`): when the thread has stayed in one place outside a collective
for half the collective timeout, the watcher leaves a record beside the worker's error
file, and takes it back once the thread moves on. When the job fails on a timeout, the
launcher reads the records of the workers still running (`read_stuck`): such a worker is
the one the others waited for, and it cannot take the launcher's SIGTERM (that only asks
for a checkpoint after the step), so the launcher kills it and names it.

"In one place" is a frame of the main thread's stack that stays on it: a spinning loop,
with or without calls, or a wait on a lock, never leaves its frame, while a working rank's
innermost frames come and go between samples. "In a collective" is torch's distributed
code (c10d, FSDP, functional collectives, pipeline schedules) or our pipeline's wait as the
innermost frame outside torch's other modules (a functional collective waits through
`torch._ops`), where the thread sits until its peer answers or its timeout expires.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import NamedTuple

import torch
import torch.distributed

from titanlite.errors import ERROR_FILE_ENV, LAUNCHER_PID_ENV
from titanlite.parallel.distributed import collective_timeout
from titanlite.parallel.pipeline import wait_with_timeout

_TORCH = os.path.dirname(torch.__file__)
_TORCH_DISTRIBUTED = os.path.dirname(torch.distributed.__file__)
_STDLIB = sysconfig.get_paths()["stdlib"]
SAMPLE_S = 0.5


class Stuck(NamedTuple):
    """What a worker's record says: how long its main thread has been stuck, and where."""

    seconds: float
    where: str


def record_path(error_file: str) -> str:
    """The record of the worker whose torchelastic error file is `error_file` (its own folder)."""
    return os.path.join(os.path.dirname(error_file), "stuck.json")


def read_stuck(error_file: str) -> Stuck | None:
    """The worker's record, if its main thread is stuck (see the module doc)."""
    try:
        with open(record_path(error_file)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return Stuck(time.time() - record["since"], record["where"])


def _in_collective(frame: FrameType | None) -> bool:
    """Whether the innermost frame outside torch's other modules is a collective's wait."""
    while frame is not None and _in(frame, _TORCH) and not _in(frame, _TORCH_DISTRIBUTED):
        frame = frame.f_back
    return frame is not None and (_in(frame, _TORCH_DISTRIBUTED) or frame.f_code is wait_with_timeout.__code__)


def _in(frame: FrameType, folder: str) -> bool:
    return frame.f_code.co_filename.startswith(folder + os.sep)


def _where(frame: FrameType) -> str:
    """The innermost frame outside Python's standard library (a lock's wait is the caller's)."""
    outside = (f for f, _ in traceback.walk_stack(frame) if not f.f_code.co_filename.startswith(_STDLIB))
    frame = next(outside, frame)
    return f"{frame.f_code.co_name}, {os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"


def _stack_keys(frame: FrameType) -> list[tuple[int, object]]:
    """The stack's frames as (id, code): kept between samples without keeping a frame (and its
    tensors) alive."""
    return [(id(f), f.f_code) for f, _ in traceback.walk_stack(frame)]


class _Watcher(threading.Thread):
    """Samples the main thread every SAMPLE_S and keeps its record (see the module doc)."""

    def __init__(self, path: str):
        super().__init__(name="titanlite-stuck-watcher", daemon=True)
        self.path, self.main = path, threading.main_thread().ident
        self.done = threading.Event()

    def run(self) -> None:
        anchor, since, recorded = None, 0.0, False
        while not self.done.wait(SAMPLE_S):
            frame = sys._current_frames().get(self.main)
            if frame is None or _in_collective(frame):
                anchor = None
            elif anchor is None or anchor not in _stack_keys(frame):
                anchor, since = (id(frame), frame.f_code), time.monotonic()
            timeout = collective_timeout()
            held = time.monotonic() - since
            stuck = anchor is not None and timeout is not None and held >= timeout.total_seconds() / 2
            if stuck and not recorded:
                self._write(time.time() - held, _where(frame))
            elif recorded and not stuck:
                self._remove()
            recorded = stuck
            del frame  # no frame (nor its tensors) kept alive while sleeping
        if recorded:
            self._remove()

    def _write(self, since: float, where: str) -> None:
        partial = f"{self.path}.partial"
        with open(partial, "w") as f:
            json.dump({"since": since, "where": where}, f)
        os.replace(partial, self.path)  # the launcher never reads half a record

    def _remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


@contextlib.contextmanager
def watch_main_thread() -> Iterator[None]:
    """Watch this worker's main thread for as long as the block runs, under `titanlite.launch`
    (elsewhere no launcher reads the record: nothing is started)."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if not (error_file and os.environ.get(LAUNCHER_PID_ENV)):
        yield
        return
    watcher = _Watcher(record_path(error_file))
    watcher.start()
    try:
        yield
    finally:
        watcher.done.set()
        watcher.join()
