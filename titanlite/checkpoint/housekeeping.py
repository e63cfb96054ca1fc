"""Slow file-system work of rank 0, done off the training step by one daemon thread.

Deleting an old checkpoint on a parallel file system can take minutes for a multi-TB
folder. Done inline, rank 0 would sit in `shutil.rmtree` while every other rank waits in
the next step's collective, long enough to time it out. So rank 0 only retires a folder
inside the step (un-commit and rename into `.trash/`: `commit.retire`) and hands the
delete to this thread, which the checkpoint manager joins at close. A crash mid-delete
leaves a folder under `.trash/` that no discovery looks at; the next run's housekeeper
finishes it.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from pathlib import Path

from titanlite.logging import logger


class Housekeeper:
    """A queue of paths (folders or files) to delete, drained by one daemon thread."""

    def __init__(self, leftovers: Path) -> None:
        """Starts with the deletes an earlier run left under `leftovers` (the `.trash/` folder:
        it crashed, or was killed)."""
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="titanlite-housekeeping", daemon=True)
        self._thread.start()
        for entry in sorted(leftovers.iterdir()) if leftovers.is_dir() else ():
            self.delete(entry)

    def delete(self, path: str | os.PathLike) -> None:
        """Delete `path` in the background (a folder with everything in it, or a file)."""
        self._queue.put(Path(path))

    def close(self) -> None:
        """Finish every queued delete, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    def _drain(self) -> None:
        while (path := self._queue.get()) is not None:
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            except OSError as error:  # a delete that fails costs disk space, not the run
                logger.warning(f"checkpoint: could not delete {path}: {error}")
