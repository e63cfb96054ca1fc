"""`Checkpointer`: the save pipeline for any model, optimizer and `Stateful` objects, with no
config: async save, atomic commit, retention, exact resume at any layout. The trainer's
`CheckpointManager` adds its policy (when, what kind, the run's records) on top of this one
pipeline (`save_state`), and a library user calls `save` / `load` directly.

The commit protocol: rank 0 writes `commit.json` once its own DCP save finished. For DCP
that means the coordinator already gathered every rank's write results and wrote
`.metadata`, so no barrier is needed, and an async save costs no synchronisation at all:
rank 0 checks its future at each `save` call and at `wait`/`close`, and commits as soon as it
resolved without error. A rank dying mid-save leaves a folder without `commit.json`;
discovery skips it and the previous checkpoint stays newest. The commit records each shard
file's checksum (`integrity.py`), checked before a load. Folders that go (retention, an
overwrite) are retired at once and deleted by rank 0's housekeeping thread.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

from titanlite.checkpoint import commit, integrity, policy
from titanlite.checkpoint.async_save import Saver, build_saver
from titanlite.checkpoint.contents import FLAT_OPTIMIZER
from titanlite.checkpoint.housekeeping import Housekeeper
from titanlite.checkpoint.restore import dcp_load, read_checked_metadata
from titanlite.errors import TitanliteError, user_errors
from titanlite.logging import logger
from titanlite.parallel.collectives import on_rank0
from titanlite.parallel.distributed import collective_failure, new_group
from titanlite.parallel.state_dict import checkpoint_module

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


@dataclass
class _PendingSave:
    """The one async save that may be in flight."""

    step: int
    path: Path
    record: commit.CommitRecord
    future: Future
    started: float


class Checkpointer:
    """Saves `model` (sharded: each rank its DTensor shards), `optimizer` and every `Stateful`
    in `states` (by key) into `<folder>/step-<N>`; `load` resumes from the newest complete one
    at any layout (DCP reshards by name). Every rank builds one with the same arguments.

    async_mode: "async" (a background thread writes; `save` returns after handing the state
    over), "async_with_pinned_mem" (a writer process), or "disabled" (`save` blocks).
    keep_latest_k: committed checkpoints kept (0 = all).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        model: nn.Module | None = None,
        optimizer: Optimizer | None = None,
        states: dict[str, Stateful] | None = None,
        async_mode: str = "async",
        keep_latest_k: int = 0,
    ):
        if async_mode not in ASYNC_MODES:
            raise TitanliteError(
                f"Checkpointer: async_mode must be one of {', '.join(ASYNC_MODES)}, got {async_mode!r}"
            )
        if isinstance(keep_latest_k, bool) or not isinstance(keep_latest_k, int) or keep_latest_k < 0:
            raise TitanliteError(
                f"Checkpointer: keep_latest_k must be a whole number >= 0 (0 = keep all), got {keep_latest_k!r}"
            )
        if optimizer is not None and model is None:
            raise TitanliteError("Checkpointer: optimizer needs the model it optimizes (model=)")
        self.states = dict(states or {})
        if clash := {"model", "optimizer"} & set(self.states):
            raise TitanliteError(
                f"Checkpointer: states key {sorted(clash)[0]!r} is taken by the model or optimizer; rename it"
            )
        self.root, self.optimizer = Path(folder), optimizer
        self.model = checkpoint_module(model) if model is not None else None
        self.keep_latest_k, self.async_mode = keep_latest_k, async_mode
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        # DCP's own collectives run on a dedicated gloo group: async saves need a CPU backend,
        # and a background save must never interleave with the training's collectives.
        self.group = new_group(backend="gloo", group_desc="checkpoint") if distributed else None
        self.saver: Saver = build_saver(async_mode, self.group)
        self.housekeeper = Housekeeper(leftovers=self.root / commit.TRASH_DIR) if self.rank == 0 else None
        self._pending: _PendingSave | None = None
        self.saved_steps: set[int] = set()  # committed or in flight in this run

    # --- the library's calls ---------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Fresh state dicts of everything this checkpointer holds (to save, or to load into)."""
        state: dict[str, Any] = {key: obj.state_dict() for key, obj in self.states.items()}
        if self.optimizer is not None:
            state["model"], state["optimizer"] = get_state_dict(self.model, self.optimizer, options=FLAT_OPTIMIZER)
        elif self.model is not None:
            state["model"] = get_model_state_dict(self.model)
        return state

    def save(self, step: int, blocking: bool = False) -> Path:
        """Save everything as `step` (after the save in flight, if any); returns its folder."""
        self.wait()
        state = self.state()
        record = commit.CommitRecord(step=step, fingerprint={}, contents=sorted(state), world_size=self.world_size)
        return self.save_state(step, state, record, blocking or self.async_mode == "disabled")

    def load(self, step: int | None = None) -> int | None:
        """Load the newest complete checkpoint (or exactly `step`) into the live objects;
        returns its step, or None when the folder holds none (start fresh)."""
        self.wait()  # a save of this run still in flight is committed first, so it counts
        choice = on_rank0(self.group, lambda: policy.choose_resume(self.root, -1 if step is None else step))
        if choice.step is None:
            return None
        on_rank0(self.group, lambda: read_checked_metadata(choice.path), broadcast_result=False)
        integrity.verify(choice.path, choice.record.checksums, self.group)
        state = self.state()
        dcp_load(state, choice.path, self.group)
        if self.optimizer is not None:  # before the model, as `set_state_dict` does
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=FLAT_OPTIMIZER)
        if self.model is not None:
            set_model_state_dict(self.model, state["model"])
        for key, obj in self.states.items():
            obj.load_state_dict(state[key])
        return choice.step

    # --- the pipeline (the trainer's manager uses it too) -------------------------------------

    def save_state(self, step: int, state: dict[str, Any], record: commit.CommitRecord, blocking: bool) -> Path:
        """Write `state` as `step` and commit it with `record`: now (`blocking`), or in the
        background, committed by a later `poll`/`wait`. One save at a time: call `wait` first."""
        started = time.perf_counter()
        path = self._prepare_folder(step)
        self.saved_steps.add(step)
        if blocking:
            with _save_errors(path):
                self.saver.blocking_save(state, path)
            self._commit(step, path, record, time.perf_counter() - started)
        else:
            self._pending = _PendingSave(step, path, record, self.saver.save(state, path), started)
            logger.info(
                f"checkpoint: step {step} staged in {time.perf_counter() - started:.2f} s, writing {path} in the "
                f"background ({self.async_mode})"
            )
        return path

    def poll(self) -> None:
        """Commit an async save as soon as it is done, without waiting: a crash a few steps
        later should not cost a checkpoint that was already fully written."""
        if self._pending is not None and self._pending.future.done():
            self._finish(self._pending)

    def wait(self) -> None:
        """Block until the in-flight async save (if any) finished, then commit it."""
        if self._pending is not None:
            self._finish(self._pending)

    def close(self) -> None:
        """Wait for the in-flight save, release the saver and finish the background deletes."""
        try:
            self.wait()
        finally:
            self.saver.close()
            if self.housekeeper is not None:
                self.housekeeper.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def _finish(self, pending: _PendingSave) -> None:
        self._pending = None
        with _save_errors(pending.path):
            pending.future.result()
        self._commit(pending.step, pending.path, pending.record, time.perf_counter() - pending.started)

    def _commit(self, step: int, path: Path, record: commit.CommitRecord, seconds: float) -> None:
        """Rank 0 only: record the shards' checksums and write the marker, then retire what
        retention lets go (their part of the save is on disk already: DCP finished)."""
        if self.rank != 0:
            return
        record.checksums = integrity.collect(path)
        commit.write_commit(path, record)
        for sidecar in integrity.sidecars(path):  # merged into commit.json now
            self.housekeeper.delete(sidecar)
        logger.info(
            f"checkpoint: step {step} committed to {path} ({seconds:.2f} "
            f"s{', model weights only' if record.model_weights_only else ''})"
        )
        if policy.is_export(record):
            return  # an export must not push the newest resumable checkpoint out of retention
        inventory = commit.scan(self.root)
        in_flight = {self._pending.step} if self._pending is not None else set()
        victims = policy.retention_victims(inventory.complete, self.keep_latest_k, step)
        for old in victims + policy.stale_incomplete(inventory.incomplete, step):
            if old != step and old not in in_flight:  # never the newest commit or a save in flight
                self._retire(old)
        if victims:
            logger.info(
                f"checkpoint: removed step(s) {', '.join(map(str, victims))} (keep_latest_k {self.keep_latest_k})"
            )

    def _retire(self, step: int) -> None:
        """Un-commit and move a step folder aside now; delete it in the background."""
        if (retired := commit.retire(self.root, step)) is not None:
            self.housekeeper.delete(retired)

    def _prepare_folder(self, step: int) -> Path:
        """Rank 0 clears the target folder (retiring it) while the other ranks wait: DCP's writer
        makes the folder on every rank in its local planning (`prepare_local_plan`), before any
        collective, and a rank making it while rank 0 moved the old one aside failed
        (FileExistsError: mkdir found the folder, is_dir no longer did)."""
        path = commit.step_dir(self.root, step)

        def clear() -> None:
            if path.exists():
                if path.is_dir() and commit.read_commit(path) is not None:
                    logger.warning(f"checkpoint: overwriting the existing checkpoint {path}")
                self._retire(step)

        on_rank0(self.group, clear, broadcast_result=False)
        return path


def _save_errors(path: Path) -> contextlib.AbstractContextManager:
    """A failed save is one line (DCP raises CheckpointException, a BaseException), except a
    collective whose peer died or hung inside DCP: that stays the trainer's collective-failure
    line and exit code, so the launcher names the rank that failed first, not this one."""
    return user_errors(f"checkpoint: saving {path} failed", keep=collective_failure)
