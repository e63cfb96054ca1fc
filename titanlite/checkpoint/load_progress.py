"""Progress lines for long checkpoint loads: a DCP restore and a Hugging Face import.

Loading a large checkpoint is minutes of silence otherwise: `dcp.load` is one call, and
an 8B import reads 16 GB of safetensors before the first step. Both report through
`titanlite.observe.progress.Progress` (rank 0 prints): one line before (how much there is), a line
at most every few seconds while reading (how far, time left), one after (how much, how
long).

`ProgressReader` (DCP's own `FileSystemReader`) and `HFProgressReader` (its
`HuggingFaceStorageReader`) are changed in one place: `read_data` hands DCP's load planner
on wrapped, so that each item counts its bytes as it lands (the planner's public
`load_bytes` / `commit_tensor` callbacks); the reading itself is DCP's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from titanlite.logging import logger
from titanlite.observe.progress import Progress, amount_text


class _CountingPlanner:
    """DCP's load planner, unchanged, except that each item read advances `progress` by
    its size in the files."""

    def __init__(self, planner: LoadPlanner, size_of: Callable[[ReadItem], int], progress: Progress):
        self._planner, self._size_of, self._progress = planner, size_of, progress

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self._planner.load_bytes(read_item, value)
        self._progress.advance(self._size_of(read_item))

    def commit_tensor(self, read_item: ReadItem, tensor: Any) -> None:
        self._planner.commit_tensor(read_item, tensor)
        self._progress.advance(self._size_of(read_item))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


def _read_with_progress(reader: Any, total: int, files: int, size_of: Callable[[ReadItem], int],
                        plan: LoadPlan, planner: LoadPlanner, read: Callable[..., Any]) -> Any:
    mine = sum(size_of(item) for item in plan.items)
    logger.info(f"checkpoint load: {reader.path} holds {amount_text(total, 'B')} in "
                f"{amount_text(files, 'files' if files != 1 else 'file')}; this rank reads {amount_text(mine, 'B')}")
    progress = Progress(f"checkpoint load: {Path(reader.path).name}", total=mine, unit="B", every_s=reader.every_s)
    done = read(plan, _CountingPlanner(planner, size_of, progress))
    progress.finish()
    return done


class ProgressReader(FileSystemReader):
    """A `FileSystemReader` that says what it loads, how far it got and how long it took."""

    def __init__(self, path: str | os.PathLike, every_s: float = 5.0):
        super().__init__(path)
        self.every_s = every_s

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        stored = self.storage_data.values()
        return _read_with_progress(self, sum(s.length for s in stored), len({s.relative_path for s in stored}),
                                   lambda item: self.storage_data[item.storage_index].length, plan, planner, super().read_data)


class HFProgressReader(HuggingFaceStorageReader):
    """A `HuggingFaceStorageReader` that says the same: an item's size is its slice's
    elements times the stored dtype's size (what safetensors reads)."""

    def __init__(self, path: str | os.PathLike, every_s: float = 5.0):
        super().__init__(str(path))
        self.every_s = every_s

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        stored = self.storage_data.values()
        total = sum(math.prod(s.shape) * s.dtype.itemsize for s in stored)

        def size_of(item: ReadItem) -> int:
            return math.prod(item.lengths) * self.storage_data[item.storage_index].dtype.itemsize

        return _read_with_progress(self, total, len({s.relative_path for s in stored}), size_of, plan, planner, super().read_data)
