"""Start-up checks on the dump folder, and the lock that gives it to one job at a time.

Before any device work, rank 0 makes sure the run can keep what it produces: the dump
folder can be created and written (not under a file, not read-only), the checkpoint folder
can be, the disk there holds at least one checkpoint of this model, and no other job is
using the folder. Two jobs in one dump folder resume each other's checkpoints, overwrite
each other's steps and delete each other's saves through retention.

The lock is `<dump_folder>/.titanlite.lock`: a `fcntl.flock` held by rank 0 for the whole
run (the kernel drops it when the process dies, however it dies) and, inside, the holder's
host, pid and start time, for the message a second job prints and for file systems where
flock is not supported (there a holder on this host whose pid is gone is stale; one on
another host cannot be checked and is refused with the file to delete). A clean exit
empties the file, so a lock left with a holder in it and free means that job died: it is
taken over with a warning. The decisions are rank 0's, broadcast (`on_rank0`), so every
rank exits alike with the same one line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from titanlite.errors import TitanliteError
from titanlite.logging import logger
from titanlite.parallel.collectives import on_rank0

if TYPE_CHECKING:
    from titanlite.config import JobConfig

LOCK_FILE = ".titanlite.lock"
GIB = 1024**3
# flock errors that mean "this file system does not do flock", not "someone holds it".
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


# --------------------------------------------------------------------------------------
# Writable folders
# --------------------------------------------------------------------------------------


def _why_not_writable(error: OSError) -> str:
    if error.errno == errno.EROFS:
        return "it is on a read-only file system"
    if isinstance(error, PermissionError):
        return "permission denied"
    return error.strerror or str(error)


def _refuse_file_in_the_way(folder: Path, field: str) -> None:
    """Refuse `folder` when it or its nearest ancestor that exists is not a folder."""
    for candidate in (folder, *folder.parents):
        if candidate.exists() or candidate.is_symlink():
            if not candidate.is_dir():
                raise TitanliteError(f"{field}: cannot create the folder {folder}: {candidate} is a file")
            return


def _probe_write(folder: Path, field: str) -> None:
    """Create and delete a file in `folder`: `os.access` says yes to root on a read-only mount."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".titanlite-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise TitanliteError(f"{field}: cannot write in {folder}: {_why_not_writable(error)}") from None


def make_writable_folder(folder: Path, field: str) -> None:
    """Create `folder` (and its parents) and check a file can be written in it."""
    _refuse_file_in_the_way(folder, field)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise TitanliteError(f"{field}: cannot create the folder {folder}: {_why_not_writable(error)}") from None
    _probe_write(folder, field)


def check_creatable_folder(folder: Path, field: str) -> Path:
    """`folder`, or the nearest ancestor it would be created in, is a writable folder
    (nothing is created: an absent checkpoint folder means something to a resume).
    Returns that existing folder."""
    _refuse_file_in_the_way(folder, field)
    existing = next(p for p in (folder, *folder.parents) if p.is_dir())
    _probe_write(existing, field)
    return existing


# --------------------------------------------------------------------------------------
# Free disk for one checkpoint
# --------------------------------------------------------------------------------------


def checkpoint_bytes(n_params: int, weights_only: bool) -> int:
    """One checkpoint's size: fp32 weights, plus AdamW's two fp32 moments unless weights only."""
    return n_params * 4 * (1 if weights_only else 3)


def check_free_disk(folder: Path, n_params: int, weights_only: bool) -> None:
    """Refuse a run whose first checkpoint cannot fit on the disk of `folder`."""
    needed = checkpoint_bytes(n_params, weights_only)
    if (free := shutil.disk_usage(folder).free) < needed:
        what = "fp32 weights" if weights_only else "fp32 weights and AdamW's two moments"
        raise TitanliteError(
            f"checkpoint.folder: the disk of {folder} has {free / GIB:,.1f} GiB free, but one checkpoint of "
            f"{n_params / 1e9:,.2f}B parameters ({what}) needs {needed / GIB:,.1f} GiB"
        )


# --------------------------------------------------------------------------------------
# The lock
# --------------------------------------------------------------------------------------


def _holder_text(holder: dict) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


def _read_holder(fd: int) -> dict:
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    try:
        holder = json.loads(text) if text else {}
    except ValueError:
        return {"host": "?", "pid": "?", "started": f"unreadable lock contents {text[:40]!r}"}
    return holder if isinstance(holder, dict) else {}


def _try_flock(fd: int) -> bool | None:
    """True: taken; False: another process holds it; None: the file system has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in _NO_FLOCK:
            return None
        raise


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _refusal(path: Path, holder: dict, flocked: bool | None) -> str | None:
    """Why the lock cannot be taken, or None when it is free (or stale)."""
    folder, unknown = path.parent, flocked is None and bool(holder)  # no flock: the holder's record decides
    if unknown and holder.get("host") != socket.gethostname():
        return (
            f"job.dump_folder: {folder} is locked by a run on another host ({_holder_text(holder)}) and this "
            f"file system cannot tell whether it still runs; delete {path} if it does not"
        )
    if flocked is False or (unknown and _pid_alive(holder.get("pid"))):
        return f"job.dump_folder: {folder} is in use by another run ({_holder_text(holder)}; lock file {path})"
    return None


class RunLock:
    """Rank 0's hold on the dump folder; `release` at the end of the run. Released when
    garbage-collected or at exit too, so a start-up that fails after taking it frees it."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._finalizer = weakref.finalize(self, RunLock._release, fd)

    @staticmethod
    def _release(fd: int) -> None:
        try:
            os.ftruncate(fd, 0)  # empty: the next run takes it without a stale-lock warning
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(fd)

    def release(self) -> None:
        self._finalizer()


def acquire_lock(folder: Path) -> RunLock:
    """Take `<folder>/.titanlite.lock` for this process, or refuse in one line naming the holder."""
    path = folder / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise TitanliteError(f"job.dump_folder: cannot open the lock file {path}: {_why_not_writable(error)}") from None
    flocked = _try_flock(fd)
    holder = _read_holder(fd)
    if (problem := _refusal(path, holder, flocked)) is not None:
        os.close(fd)
        raise TitanliteError(problem)
    if holder:
        logger.warning(
            f"job.dump_folder: taking over the lock {path} of a run that ended without releasing it "
            f"({_holder_text(holder)})"
        )
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    return RunLock(path, fd)


# --------------------------------------------------------------------------------------
# The start-up sequence
# --------------------------------------------------------------------------------------


def written_folders(cfg: JobConfig) -> list[tuple[str, str]]:
    """(field, folder under the dump folder) of every folder this run will write besides its
    checkpoints: the run folder, and TensorBoard, traces and memory snapshots when on. A file
    in the way of one is found at start-up, not when the first trace is written (torch's
    profiler crashed the process on it, SIGSEGV, naming nothing)."""
    wanted = [
        ("metrics.save_runs_folder", cfg.metrics.save_runs_folder, True),
        ("metrics.save_tb_folder", cfg.metrics.save_tb_folder, cfg.metrics.enable_tensorboard),
        ("profiling.save_traces_folder", cfg.profiling.save_traces_folder, cfg.profiling.enable_profiling),
        (
            "profiling.save_memory_snapshot_folder",
            cfg.profiling.save_memory_snapshot_folder,
            cfg.profiling.enable_memory_snapshot,
        ),
    ]
    return [(field, folder) for field, folder, used in wanted if used]


def claim_dump_folder(
    cfg: JobConfig, n_params: Callable[[], int], group: dist.ProcessGroup | None, weights_only: bool = False
) -> RunLock | None:
    """Every start-up check on the run's folders, then the lock (rank 0; the others get None,
    or the same one-line error). `n_params` is asked only when checkpoints are saved."""

    def decide() -> RunLock:
        dump = Path(cfg.job.dump_folder)
        make_writable_folder(dump, "job.dump_folder")
        for field, folder in written_folders(cfg):
            check_creatable_folder(dump / folder, field)
        if cfg.checkpoint.enable_checkpoint or cfg.checkpoint.create_seed_checkpoint:
            existing = check_creatable_folder(dump / cfg.checkpoint.folder, "checkpoint.folder")
            check_free_disk(existing, n_params(), weights_only)
        return acquire_lock(dump)

    return on_rank0(group, decide, broadcast_result=False)
