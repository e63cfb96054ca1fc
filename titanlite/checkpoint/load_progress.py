"""Progress lines for long checkpoint loads: a DCP restore and a Hugging Face import.

Loading a large checkpoint is minutes of silence otherwise: `dcp.load` is one call, and
an 8B import reads 16 GB of safetensors before the first step. Both report through
`titanlite.observe.progress.Progress` (rank 0 prints): one line before (how much there is), a line
at most every few seconds while reading (how far, time left), one after (how much, how
long).

`ProgressReader` is DCP's own `FileSystemReader`, changed in one place: `read_data` hands
DCP's load planner on wrapped, so that each item counts its bytes as it lands (the
planner's public `load_bytes` / `commit_tensor` callbacks); the reading itself is DCP's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from titanlite.logging import logger
from titanlite.observe.progress import Progress, amount_text


class _CountingPlanner:
    """DCP's load planner, unchanged, except that each item read advances `progress` by
    its stored size."""

    def __init__(self, planner: LoadPlanner, storage_data: dict[Any, Any], progress: Progress):
        self._planner, self._storage_data, self._progress = planner, storage_data, progress

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self._planner.load_bytes(read_item, value)
        self._progress.advance(self._storage_data[read_item.storage_index].length)

    def commit_tensor(self, read_item: ReadItem, tensor: Any) -> None:
        self._planner.commit_tensor(read_item, tensor)
        self._progress.advance(self._storage_data[read_item.storage_index].length)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class ProgressReader(FileSystemReader):
    """A `FileSystemReader` that says what it loads, how far it got and how long it took."""

    def __init__(self, path: str | os.PathLike, every_s: float = 5.0):
        super().__init__(path)
        self.every_s = every_s

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        stored = self.storage_data.values()
        files = len({s.relative_path for s in stored})
        mine = sum(self.storage_data[item.storage_index].length for item in plan.items)
        logger.info(f"checkpoint load: {self.path} holds {amount_text(sum(s.length for s in stored), 'B')} in "
                    f"{amount_text(files, 'files' if files != 1 else 'file')}; this rank reads {amount_text(mine, 'B')}")
        progress = Progress(f"checkpoint load: {Path(self.path).name}", total=mine, unit="B", every_s=self.every_s)
        done = super().read_data(plan, _CountingPlanner(planner, self.storage_data, progress))
        progress.finish()
        return done


def files_with_progress(what: str, folder: Path, names: Sequence[str], every_s: float = 5.0) -> Iterator[str]:
    """Yield each of `names` (files in `folder`, read whole by the caller) and count its
    size once the caller is done with it. A missing file counts as empty: reading it is
    the caller's error to report."""
    sizes = [(folder / name).stat().st_size if (folder / name).is_file() else 0 for name in names]
    logger.info(f"{what}: {amount_text(len(names), 'files' if len(names) != 1 else 'file')}, {amount_text(sum(sizes), 'B')}")
    progress = Progress(what, total=sum(sizes), unit="B", every_s=every_s)
    for name, size in zip(names, sizes):
        yield name
        progress.advance(size)
    progress.finish()
