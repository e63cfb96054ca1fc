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


class _Reporting:
    """`read_data` for a DCP reader class that says what it loads, how far it got and how
    long it took. The reader says what its stored pieces and read items weigh."""

    def __init__(self, path: str | os.PathLike, every_s: float = 5.0):
        super().__init__(str(path))
        self.every_s = every_s

    def _stored_bytes(self, info: Any) -> int:
        raise NotImplementedError

    def _item_bytes(self, item: ReadItem) -> int:
        raise NotImplementedError

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        stored = self.storage_data.values()
        files = len({s.relative_path for s in stored})
        mine = sum(self._item_bytes(item) for item in plan.items)
        logger.info(
            f"checkpoint load: {self.path} holds {amount_text(sum(self._stored_bytes(s) for s in stored), 'B')} in "
            f"{amount_text(files, 'files' if files != 1 else 'file')}; this rank reads {amount_text(mine, 'B')}"
        )
        progress = Progress(f"checkpoint load: {Path(self.path).name}", total=mine, unit="B", every_s=self.every_s)
        done = super().read_data(plan, _CountingPlanner(planner, self._item_bytes, progress))
        progress.finish()
        return done


class ProgressReader(_Reporting, FileSystemReader):
    """A `FileSystemReader` that reports its load: an item weighs its stored bytes."""

    def _stored_bytes(self, info: Any) -> int:
        return info.length

    def _item_bytes(self, item: ReadItem) -> int:
        return self.storage_data[item.storage_index].length


class HFProgressReader(_Reporting, HuggingFaceStorageReader):
    """A `HuggingFaceStorageReader` that reports its load: an item weighs its slice's
    elements times the stored dtype's size (what safetensors reads)."""

    def _stored_bytes(self, info: Any) -> int:
        return math.prod(info.shape) * info.dtype.itemsize

    def _item_bytes(self, item: ReadItem) -> int:
        return math.prod(item.lengths) * self.storage_data[item.storage_index].dtype.itemsize
