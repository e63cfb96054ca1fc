"""Checkpoint policy: which steps save and how, which checkpoint loads, which ones go.

Pure rules: they read commit records through `commit.py` (rank 0's view of the disk) and
never touch tensors or process groups, so each is unit-testable without torch.distributed.
The mechanism is elsewhere: the save pipeline in `manager.py`, loading in `restore.py`,
the bytes per `async_mode` in `async_save.py`, the on-disk layout in `commit.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from titanlite.checkpoint.commit import COMMIT_FILE, DCP_METADATA_FILE, CommitRecord, read_commit, scan, step_dir
from titanlite.errors import TitanliteError

if TYPE_CHECKING:
    from titanlite.config import Checkpoint


def should_save(step: int, interval: int, last: bool) -> bool:
    """Save every `interval` steps and always at the last step."""
    return last or step % interval == 0


@dataclass(frozen=True)
class SaveKind:
    """How one due save is done."""

    # Model only: the final save of a `model_weights_only` run (an export), or the seed.
    weights_only: bool
    # The dtype an export's weights are cast to; None keeps the training dtype.
    export_dtype: str | None
    # The caller waits for the write: nothing is left to overlap with at the last step,
    # and async_mode "disabled" asks for it.
    blocking: bool


# `create_seed_checkpoint`: the freshly initialized weights as step 0, model only, as trained.
SEED_SAVE = SaveKind(weights_only=True, export_dtype=None, blocking=True)


def save_kind(cfg: Checkpoint, last: bool) -> SaveKind:
    """The save of a training step: the whole training state, in the background, except
    at the last step, which is blocking and holds only the model when
    `model_weights_only` (cast to `export_dtype`)."""
    weights_only = last and cfg.model_weights_only
    return SaveKind(
        weights_only=weights_only,
        export_dtype=cfg.export_dtype if weights_only else None,
        blocking=last or cfg.async_mode == "disabled",
    )


def is_export(record: CommitRecord) -> bool:
    """A weights-only checkpoint after step 0 is an export: it has no optimizer or data
    state to resume from, and it does not count for retention. The step-0 seed checkpoint
    is the exception: it is how a seed initializes a run."""
    return record.model_weights_only and record.step > 0


@dataclass(frozen=True)
class LoadChoice:
    """Which checkpoint to resume from (None: start fresh) and what to say about it."""

    step: int | None
    path: Path | None
    record: CommitRecord | None
    notes: tuple[str, ...] = ()


def choose_resume(root: str | os.PathLike, load_step: int) -> LoadChoice:
    """Pick the checkpoint a run resumes from.

    load_step -1: the newest committed full checkpoint (exports are skipped, see
    `is_export`). None when the folder has none, so the run starts fresh. load_step >= 0:
    exactly that step, or a one-line error; a load that was asked for never degrades into a
    fresh start.
    """
    root = Path(root)
    inventory = scan(root)
    notes = [w] if (w := inventory.incomplete_warning()) else []
    if load_step >= 0:
        path = step_dir(root, load_step)
        if not root.is_dir():
            raise TitanliteError(
                f"checkpoint.load_step: {load_step} was asked for, but the checkpoint folder {root} does not exist"
            )
        if load_step in inventory.incomplete:
            raise TitanliteError(
                f"checkpoint.load_step: {path} is incomplete (no {COMMIT_FILE}: its save was interrupted); complete "
                f"steps: {_steps(inventory.complete)}"
            )
        if load_step not in inventory.complete:
            raise TitanliteError(
                f"checkpoint.load_step: {path} does not exist; complete steps: {_steps(inventory.complete)}"
            )
        record = read_commit(path)
        if is_export(record):
            raise TitanliteError(
                f"checkpoint.load_step: {path} holds model weights only (an export) and cannot resume training; "
                "start from it with checkpoint.initial_load_path instead"
            )
        return LoadChoice(load_step, path, record, tuple(notes))
    for step in reversed(inventory.complete):
        path = step_dir(root, step)
        record = read_commit(path)
        if not is_export(record):
            return LoadChoice(step, path, record, tuple(notes))
        notes.append(f"checkpoint: skipping {path}: model weights only (an export), nothing to resume from")
    return LoadChoice(None, None, None, tuple(notes))


def _steps(steps: tuple[int, ...]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def retention_victims(complete: tuple[int, ...] | list[int], keep_latest_k: int, newest_committed: int) -> list[int]:
    """Committed steps to delete after `newest_committed` was committed: all but the newest
    `keep_latest_k` (0 keeps everything). Only called after a commit, so a newer complete
    checkpoint always exists before an older one goes."""
    if keep_latest_k <= 0:
        return []
    return sorted(s for s in complete if s <= newest_committed)[:-keep_latest_k]  # [] when k or fewer


def stale_incomplete(incomplete: tuple[int, ...] | list[int], newest_committed: int) -> list[int]:
    """Interrupted folders older than the newest commit: no save of theirs is in flight
    (a run has at most one, and it is newer), so they are debris to clean up."""
    return [s for s in incomplete if s < newest_committed]


def resolve_initial_load(
    path: str | os.PathLike, what: str = "checkpoint.initial_load_path"
) -> tuple[Path, CommitRecord | None]:
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
    if complete := scan(path).complete:
        newest = step_dir(path, complete[-1])
        return newest, read_commit(newest)
    raise TitanliteError(
        f"{what}: {path} is not a DCP checkpoint (no {DCP_METADATA_FILE}) and holds no complete step-N checkpoint"
    )
