"""Background prefetch: the next batches are read and assembled on a thread, so a training
step does not wait for data in steady state.

Batches are a pure function of their position (see windows.py), so the thread only needs
where to start and how far each batch advances; restarting at another position (a resumed
checkpoint) is stopping the thread and starting a new one. Reading from a memory map and
converting with numpy release the GIL for the bulk of the work.

A thread left running after its consumer is gone keeps reading the memory-mapped shards; if
one of them is then truncated or rewritten, the read faults (SIGBUS) and kills the process.
So the thread holds its producer's owner only weakly and stops when the owner is collected,
and `stop()` is safe to call from a finalizer.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """Calls `produce(start)`, `produce(start + stride)`, ... on a daemon thread, keeping
    up to `depth` results ready. `get()` returns them in order and re-raises, on the
    caller's thread, any exception `produce` raised. `produce` is a bound method: the thread
    does not keep its object alive and stops when that object is collected (a consumer
    dropped without `close()`)."""

    def __init__(self, produce: Callable[[int], T], start: int, stride: int, depth: int = 2) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(weakref.WeakMethod(produce), start, stride), name="titanlite-prefetch", daemon=True
        )
        weakref.finalize(produce.__self__, self.stop)
        self._thread.start()

    def _run(self, weak: weakref.WeakMethod, position: int, stride: int) -> None:
        while not self._stop.is_set():
            produce = weak()
            if produce is None:  # the owner was collected
                return
            try:
                item: tuple[bool, object] = (True, produce(position))
            except BaseException as error:  # handed to the consumer, which raises it
                item = (False, error)
            del produce  # the owner is held only while producing
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not item[0]:
                return
            position += stride

    def get(self) -> T:
        ok, value = self._queue.get()
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        """Ask the thread to end after its current item; does not wait (safe in a finalizer)."""
        self._stop.set()

    def close(self) -> None:
        self.stop()
        self._thread.join(timeout=10)
