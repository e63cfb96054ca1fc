"""Progress lines for long checkpoint loads (a DCP restore, a Hugging Face import) and for the
conversions' writes (a Hugging Face export, a DCP folder from Hugging Face weights).

Loading a large checkpoint is minutes of silence otherwise: `dcp.load` is one call, and
an 8B import reads 16 GB of safetensors before the first step. Each reports through
`titanlite.observe.progress.Progress` (rank 0 prints): one line before (how much there is), a line
at most every `PROGRESS_EVERY_S` seconds while reading or writing (how far, time left), one
after (how much, how long).

`ProgressReader` (DCP's own `FileSystemReader`) and `HFProgressReader` (its
`HuggingFaceStorageReader`) are changed in one place: `read_data` hands DCP's load planner
on wrapped, so that each item counts its bytes as it lands (the planner's public
`load_bytes` / `commit_tensor` callbacks); the reading itself is DCP's. `ProgressWriter` and
`HFProgressWriter` do the same for `write_data`: each item counts as the writer takes its
data (the planner's `resolve_data`); a file's bytes go to disk after its last item.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import (
    FileSystemReader,
    FileSystemWriter,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem

from titanlite.logging import logger
from titanlite.observe.progress import Progress, amount_text

PROGRESS_EVERY_S = 5.0
"""Seconds between two progress lines of one load or write."""


class _Counting:
    """DCP's load or save planner, unchanged, except that each item read (`load_bytes`,
    `commit_tensor`) or taken by the writer (`resolve_data`) advances `progress` by its size."""

    def __init__(self, planner: LoadPlanner | SavePlanner, size_of: Callable[[Any], int], progress: Progress):
        self._planner, self._size_of, self._progress = planner, size_of, progress

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self._planner.load_bytes(read_item, value)
        self._progress.advance(self._size_of(read_item))

    def commit_tensor(self, read_item: ReadItem, tensor: Any) -> None:
        self._planner.commit_tensor(read_item, tensor)
        self._progress.advance(self._size_of(read_item))

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = self._planner.resolve_data(write_item)
        self._progress.advance(self._size_of(write_item))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class _Reported:
    """The base of a DCP reader or writer class that says what it reads or writes, how far it
    got and how long it took (`read_data` or `write_data`, with a counting planner)."""

    def __init__(self, path: str | os.PathLike, *args: Any, every_s: float | None = None, **kwargs: Any):
        super().__init__(str(path), *args, **kwargs)
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s

    def _reported(self, what: str, total: int, size_of: Callable[[Any], int], run: Callable, plan: Any, planner: Any):
        """`run(plan, planner)` (the base class's read or write) with a counting planner."""
        progress = Progress(f"{what}: {Path(str(self.path)).name}", total=total, unit="B", every_s=self.every_s)
        done = run(plan, _Counting(planner, size_of, progress))
        progress.finish()
        return done


class _Reporting(_Reported):
    """`read_data` for a DCP reader class; the reader says what its stored pieces and read
    items weigh (`_stored_bytes(info)`, `_item_bytes(item)`)."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        stored = self.storage_data.values()
        files = len({s.relative_path for s in stored})
        mine = sum(self._item_bytes(item) for item in plan.items)
        logger.info(
            f"checkpoint load: {self.path} holds {amount_text(sum(self._stored_bytes(s) for s in stored), 'B')} in "
            f"{amount_text(files, 'files' if files != 1 else 'file')}; this rank reads {amount_text(mine, 'B')}"
        )
        return self._reported("checkpoint load", mine, self._item_bytes, super().read_data, plan, planner)


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


def _write_bytes(item: WriteItem) -> int:
    """A tensor item's bytes (its chunk's elements times its dtype's size); 0 for the small
    pickled objects DCP writes as bytes."""
    data = item.tensor_data
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize if data is not None else 0


class _ReportingWrites(_Reported):
    """`write_data` for a DCP writer class: what this rank writes."""

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        total = sum(_write_bytes(item) for item in plan.items)
        logger.info(
            f"checkpoint write: {self.path} gets {amount_text(total, 'B')} "
            f"({amount_text(len(plan.items), 'items')}) from this rank"
        )
        return self._reported("checkpoint write", total, _write_bytes, super().write_data, plan, planner)


class ProgressWriter(_ReportingWrites, FileSystemWriter):
    """A `FileSystemWriter` (a DCP folder) that reports its writes."""


class HFProgressWriter(_ReportingWrites, HuggingFaceStorageWriter):
    """A `HuggingFaceStorageWriter` (safetensors files) that reports its writes."""
