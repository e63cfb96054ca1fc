"""Checkpoints on disk: the folder layout, the commit marker and how it is written.

Layout under `<job.dump_folder>/<checkpoint.folder>/`::

    step-10/               one DCP checkpoint
        __0_0.distcp ...   each rank's shards (written by DCP)
        .metadata          DCP's global index (written by the coordinator after every rank wrote)
        commit.json        our commit marker: written last, by rank 0, atomically (tmp + rename)
    step-20/ ...
    .trash/                folders on their way out (retention, overwrites): renamed here at
                           once, deleted in the background (`housekeeping.py`)

A folder counts as a checkpoint only when `commit.json` is present. DCP itself writes
`.metadata` only after it has gathered every rank's write results, so `.metadata` already
implies "all shards are on disk"; `commit.json` adds what DCP cannot know: that this run
considers the save finished (for async saves: that the save's future resolved without an
error), plus the model fingerprint and what the checkpoint holds. A crash at any moment
before the rename of `commit.json` leaves a folder without it, which discovery ignores.

Everything here runs on rank 0's view of the file system and touches no tensors and no
process groups; which folder to load or delete is decided in `policy.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titanlite.errors import TitanliteError, one_line

COMMIT_FILE = "commit.json"
DCP_METADATA_FILE = ".metadata"
FORMAT = "titanlite-dcp-1"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The folder of one checkpoint: `<root>/step-<step>` (no zero padding: sorting is numeric)."""
    return Path(root) / f"step-{step}"


def fingerprint(name: str, flavor: str, args: Any) -> dict[str, str]:
    """A model's identity as commit records keep it; a resume compares it before reading
    any tensor. `args` is the model's hyperparameter dataclass (its repr is compared)."""
    return {"name": name, "flavor": flavor, "args": repr(args)}


def args_dict(args: Any) -> dict[str, Any]:
    """The model's hyperparameters as a plain dict for the record ({} when not a dataclass)."""
    return dataclasses.asdict(args) if dataclasses.is_dataclass(args) else {}


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
    # Shard file name -> CRC-32 hex, verified before a load (`integrity.py`); {}: unchecked.
    checksums: dict[str, str] = field(default_factory=dict)
    # The tokenizer trained with: {"path", "vocab_size", "crc32"}; a resume compares it.
    tokenizer: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    saved_at: str = ""

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> CommitRecord:
        return cls(**{k: v for k, v in json.loads(text).items() if k in cls.__dataclass_fields__})


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
        return CommitRecord.from_json(marker.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as error:
        raise TitanliteError(f"{marker}: unreadable commit marker ({error})") from None


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable; some file systems do not support fsync on folders."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


TRASH_DIR = ".trash"


def retire(root: str | os.PathLike, step: int) -> Path | None:
    """Take one step folder out of the checkpoint set at once, for a slow delete later:
    un-commit it (a crash from here on leaves an ignored folder), then rename it into
    `<root>/.trash/` (one metadata operation, so no step waits for a multi-TB delete).
    Returns where it went, or None when there was no such folder."""
    path = step_dir(root, step)
    if not path.exists():
        return None
    remove_commit(path)
    trash = Path(root) / TRASH_DIR
    trash.mkdir(exist_ok=True)
    target = trash / f"{path.name}.{time.time_ns()}"
    os.replace(path, target)
    return target


def read_dcp_index(folder: str | os.PathLike) -> Metadata:
    """DCP's index (`.metadata`) of a checkpoint folder: every tensor's global shape and
    dtype, and which shard file holds each piece. Missing or unreadable: one line."""
    folder = Path(folder)
    try:
        return FileSystemReader(folder).read_metadata()
    except FileNotFoundError:
        raise TitanliteError(f"{folder}: not a DCP checkpoint (no {DCP_METADATA_FILE})") from None
    except Exception as error:
        raise TitanliteError(f"{folder / DCP_METADATA_FILE}: unreadable checkpoint index ({one_line(error)})") from None


def dcp_tensors(metadata: Metadata, prefix: str = "") -> dict[str, TensorStorageMetadata]:
    """The tensors of a DCP index whose keys start with `prefix` (each one's global shape and dtype)."""
    entries = metadata.state_dict_metadata.items()
    return {k: v for k, v in entries if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)}


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
        return (
            f"checkpoint: ignoring incomplete checkpoint folder(s) {names} under {self.root} (no {COMMIT_FILE}: "
            "the save was interrupted)"
        )


def scan(root: str | os.PathLike) -> Inventory:
    """List `step-N` folders under `root`, split by whether they were committed."""
    root = Path(root)
    complete, incomplete = [], []
    for entry in root.iterdir() if root.is_dir() else ():
        if (match := _STEP_DIR.match(entry.name)) and entry.is_dir():
            (complete if (entry / COMMIT_FILE).is_file() else incomplete).append(int(match.group(1)))
    return Inventory(root, tuple(sorted(complete)), tuple(sorted(incomplete)))
