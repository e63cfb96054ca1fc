"""Checkpoint policy: which steps save, which folders count, which one loads, which go.

This module only reads and writes small files on rank 0's view of the file system; it
never touches tensors or process groups, so every rule here is unit-testable without
torch.distributed. The mechanism (DCP save/load, async) lives in `manager.py` and
`async_save.py`.

Layout under `<job.dump_folder>/<checkpoint.folder>/`::

    step-10/               one DCP checkpoint
        __0_0.distcp ...   each rank's shards (written by DCP)
        .metadata          DCP's global index (written by the coordinator after every rank wrote)
        commit.json        our commit marker: written last, by rank 0, atomically (tmp + rename)
    step-20/ ...

A folder counts as a checkpoint only when `commit.json` is present. DCP itself writes
`.metadata` only after it has gathered every rank's write results, so `.metadata` already
implies "all shards are on disk"; `commit.json` adds what DCP cannot know: that this run
considers the save finished (for async saves: that the save's future resolved without an
error), plus the model fingerprint and what the checkpoint holds. A crash at any moment
before the rename of `commit.json` leaves a folder without it, which discovery ignores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titanlite.errors import TitanliteError

COMMIT_FILE = "commit.json"
DCP_METADATA_FILE = ".metadata"
FORMAT = "titanlite-dcp-1"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The folder of one checkpoint: `<root>/step-<step>` (no zero padding: sorting is numeric)."""
    return Path(root) / f"step-{step}"


def should_save(step: int, interval: int, last: bool) -> bool:
    """Save every `interval` steps and always at the last step."""
    return last or step % interval == 0


@dataclass
class CommitRecord:
    """What `commit.json` says about a checkpoint. Written last; its presence is the commit."""

    step: int
    # Model identity: {"name", "flavor", "args"}; compared before any tensor is read.
    fingerprint: dict[str, Any]
    # The top-level DCP keys this checkpoint holds: all of the training state, or just "model".
    contents: list[str]
    model_weights_only: bool = False
    # dtype of the model weights when they were cast for export, else None (training dtype).
    export_dtype: str | None = None
    # The model's hyperparameters as a plain dict, so exports can rebuild configs without the run.
    model_args: dict[str, Any] = field(default_factory=dict)
    # The layout it was saved at (informational: DCP reshards on load).
    world_size: int = 1
    mesh: dict[str, int] = field(default_factory=dict)
    tokens_seen: int = 0
    format: str = FORMAT
    saved_at: str = ""

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> CommitRecord:
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def write_commit(folder: str | os.PathLike, record: CommitRecord) -> None:
    """Mark `folder` complete: write to a temporary name, fsync, then rename (atomic on POSIX)."""
    folder = Path(folder)
    record.saved_at = record.saved_at or time.strftime("%Y-%m-%dT%H:%M:%S")
    tmp = folder / (COMMIT_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(record.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / COMMIT_FILE)
    _fsync_dir(folder)


def remove_commit(folder: str | os.PathLike) -> None:
    """Un-commit a folder before it is overwritten, so a crash mid-overwrite cannot leave a
    committed folder with mixed contents."""
    marker = Path(folder) / COMMIT_FILE
    if marker.exists():
        marker.unlink()
        _fsync_dir(Path(folder))


def read_commit(folder: str | os.PathLike) -> CommitRecord | None:
    """The commit record of `folder`, or None when it has none (never committed)."""
    marker = Path(folder) / COMMIT_FILE
    try:
        text = marker.read_text()
    except FileNotFoundError:
        return None
    try:
        return CommitRecord.from_json(text)
    except (ValueError, TypeError) as error:
        raise TitanliteError(f"{marker}: unreadable commit marker ({error})") from None


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable; some file systems do not support fsync on folders."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Inventory:
    """The checkpoints under one root: committed steps and interrupted (uncommitted) ones."""

    root: Path
    complete: tuple[int, ...]
    incomplete: tuple[int, ...]

    def incomplete_warning(self) -> str | None:
        """One line naming the half-written folders that are being ignored, or None."""
        if not self.incomplete:
            return None
        names = ", ".join(f"step-{s}" for s in self.incomplete)
        return f"checkpoint: ignoring incomplete checkpoint folder(s) {names} under {self.root} (no {COMMIT_FILE}: the save was interrupted)"


def scan(root: str | os.PathLike) -> Inventory:
    """List `step-N` folders under `root`, split by whether they were committed."""
    root = Path(root)
    complete, incomplete = [], []
    if root.is_dir():
        for entry in root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if not match or not entry.is_dir():
                continue
            step = int(match.group(1))
            (complete if (entry / COMMIT_FILE).is_file() else incomplete).append(step)
    return Inventory(root, tuple(sorted(complete)), tuple(sorted(incomplete)))


@dataclass(frozen=True)
class LoadChoice:
    """Which checkpoint to resume from (None: start fresh) and what to say about it."""

    step: int | None
    path: Path | None
    record: CommitRecord | None
    notes: tuple[str, ...] = ()


def choose_resume(root: str | os.PathLike, load_step: int) -> LoadChoice:
    """Pick the checkpoint a run resumes from.

    load_step -1: the newest committed full checkpoint (a weights-only export at step > 0
    is skipped: it has no optimizer or data state to resume; the step-0 seed checkpoint is
    the exception, it is how a seed initializes a run). None when the folder has none, so
    the run starts fresh. load_step >= 0: exactly that step, or a one-line error; a load that
    was asked for never degrades into a fresh start.
    """
    root = Path(root)
    inventory = scan(root)
    notes = [w] if (w := inventory.incomplete_warning()) else []
    if load_step >= 0:
        path = step_dir(root, load_step)
        if not root.is_dir():
            raise TitanliteError(f"checkpoint.load_step: {load_step} was asked for, but the checkpoint folder {root} does not exist")
        if load_step in inventory.incomplete:
            raise TitanliteError(f"checkpoint.load_step: {path} is incomplete (no {COMMIT_FILE}: its save was interrupted); complete steps: {_steps(inventory.complete)}")
        if load_step not in inventory.complete:
            raise TitanliteError(f"checkpoint.load_step: {path} does not exist; complete steps: {_steps(inventory.complete)}")
        record = read_commit(path)
        if record.model_weights_only and load_step > 0:
            raise TitanliteError(
                f"checkpoint.load_step: {path} holds model weights only (an export) and cannot resume training; "
                "start from it with checkpoint.initial_load_path instead"
            )
        return LoadChoice(load_step, path, record, tuple(notes))
    for step in reversed(inventory.complete):
        path = step_dir(root, step)
        record = read_commit(path)
        if record.model_weights_only and step > 0:
            notes.append(f"checkpoint: skipping {path}: model weights only (an export), nothing to resume from")
            continue
        return LoadChoice(step, path, record, tuple(notes))
    return LoadChoice(None, None, None, tuple(notes))


def _steps(steps: tuple[int, ...]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def retention_victims(complete: tuple[int, ...] | list[int], keep_latest_k: int, newest_committed: int) -> list[int]:
    """Committed steps to delete after `newest_committed` was committed: all but the newest
    `keep_latest_k` (0 keeps everything). Only called after a commit, so a newer complete
    checkpoint always exists before an older one goes."""
    if keep_latest_k <= 0:
        return []
    ordered = sorted(s for s in complete if s <= newest_committed)
    return ordered[:-keep_latest_k] if len(ordered) > keep_latest_k else []


def stale_incomplete(incomplete: tuple[int, ...] | list[int], newest_committed: int) -> list[int]:
    """Interrupted folders older than the newest commit: no save of theirs is in flight
    (a run has at most one, and it is newer), so they are debris to clean up."""
    return [s for s in incomplete if s < newest_committed]


def remove_checkpoint(root: str | os.PathLike, step: int) -> None:
    """Delete one step folder: un-commit first, so a crash mid-delete leaves an ignored folder."""
    path = step_dir(root, step)
    remove_commit(path)
    shutil.rmtree(path, ignore_errors=True)


def resolve_initial_load(path: str | os.PathLike, what: str = "checkpoint.initial_load_path") -> tuple[Path, CommitRecord | None]:
    """`checkpoint.initial_load_path` for format dcp: a DCP folder (ours, or any other DCP
    writer's such as torchtitan's), or one of our checkpoint roots (its newest committed step).
    `what` names the input in errors (the config field, or a script's argument)."""
    path = Path(path)
    if not path.exists():
        raise TitanliteError(f"{what}: {path} does not exist")
    if (path / DCP_METADATA_FILE).is_file():
        # DCP writes .metadata only after every rank's shards are on disk, so a folder from
        # another DCP writer (no commit.json) is complete too; ours also carry a fingerprint.
        return path, read_commit(path)
    inventory = scan(path)
    if inventory.complete:
        newest = step_dir(path, inventory.complete[-1])
        return newest, read_commit(newest)
    raise TitanliteError(
        f"{what}: {path} is not a DCP checkpoint (no {DCP_METADATA_FILE}) "
        "and holds no complete step-N checkpoint"
    )
