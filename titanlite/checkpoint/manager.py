"""The checkpoint manager: one run's saves, from the step that asks to the commit on disk.

What a checkpoint holds is in `contents.py`; when and how to save (and which old
checkpoints go) in `policy.py`; how bytes reach the disk per `async_mode` in
`async_save.py`; the layout and the commit marker in `commit.py`; loading in `restore.py`,
which `load` hands over to.

The commit protocol: rank 0 writes `commit.json` once its own DCP save finished. For DCP
that means the coordinator already gathered every rank's write results and wrote
`.metadata`, so no barrier is needed, and an async save costs no synchronisation at all:
rank 0 checks its future at each `save` call (every step) and at `close`, and commits as
soon as it resolved without error. A rank dying mid-save leaves a folder without
`commit.json`; discovery skips it and the previous checkpoint stays newest.

The commit also records each shard file's checksum (`integrity.py`). Folders that go
(retention, an overwrite) are retired inside the step, which is quick, and deleted by
rank 0's housekeeping thread (`housekeeping.py`), never while the other ranks wait.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from titanlite.checkpoint import commit, integrity, policy
from titanlite.checkpoint.async_save import Saver, build_saver
from titanlite.checkpoint.contents import Contents
from titanlite.checkpoint.housekeeping import Housekeeper
from titanlite.checkpoint.restore import Restorer
from titanlite.errors import user_errors
from titanlite.logging import logger
from titanlite.parallel.distributed import collective_failure, new_group

if TYPE_CHECKING:
    from titanlite.config import Checkpoint
    from titanlite.model_spec import ModelSpec


@dataclass
class _PendingSave:
    """The one async save that may be in flight."""

    step: int
    path: Path
    record: commit.CommitRecord
    future: Future
    started: float


class CheckpointManager:
    """Saves, commits and retains the training state of one run, and loads it back through
    a `Restorer` (see module doc). Every rank builds one, with the same arguments; a manager
    given only the model saves and loads weights only (the seed checkpoint)."""

    def __init__(
        self,
        cfg: Checkpoint,
        dump_folder: str,
        spec: ModelSpec,
        flavor: str,
        model_args: Any,
        *,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        lr_scheduler: LRScheduler | None = None,
        dataloader: Stateful | None = None,
        train_state: Stateful | None = None,
        tokenizer: Any = None,
    ):
        self.cfg = cfg
        self.root = Path(dump_folder) / cfg.folder
        self.fingerprint = commit.fingerprint(spec.name, flavor, model_args)
        self.model_args = commit.args_dict(model_args)
        self.contents = Contents(model, optimizer, lr_scheduler, dataloader, train_state)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        # DCP's own collectives (plans, metadata) run on a dedicated gloo group: async saves
        # need a CPU backend, and a background save must never interleave with the
        # training's NCCL/gloo collectives on the default group. Created once, by all ranks.
        self.group = new_group(backend="gloo", group_desc="checkpoint") if distributed else None
        self.saver: Saver = build_saver(cfg.async_mode, self.group)
        # `tokenizer` (anything with .path and .vocab_size): recorded, and compared on resume.
        self.tokenizer = integrity.tokenizer_record(tokenizer) if tokenizer is not None and self.rank == 0 else {}
        self.restorer = Restorer(cfg, self.root, spec, flavor, model_args, self.contents, self.group, self.tokenizer)
        self.housekeeper = Housekeeper() if self.rank == 0 else None
        if self.housekeeper is not None:
            self.housekeeper.delete_leftovers(self.root / commit.TRASH_DIR)
        self._pending: _PendingSave | None = None
        self._saved_steps: set[int] = set()  # committed or in flight in this run

    def load(self) -> None:
        """Resume, or initialize the model from `initial_load_path` (see `restore.py`)."""
        self.restorer.load()

    def save(self, step: int, last: bool) -> None:
        """Called after every step: commit a finished async save, and start a save when
        `policy.should_save` says so, as `policy.save_kind` says. At most one save is in
        flight: a new one first waits for the previous."""
        started = time.perf_counter()
        self._poll()
        if not self.cfg.enable_checkpoint or not policy.should_save(step, self.cfg.interval, last):
            return
        if step in self._saved_steps:
            return
        self.wait()
        self._save(step, policy.save_kind(self.cfg, last), started)

    def save_now(self, step: int) -> Path:
        """A blocking save of the whole training state at `step` (a preemption), after the
        save in flight; nothing new when this run saved `step` already. Returns its folder."""
        self.wait()
        if step not in self._saved_steps:
            self._save(step, policy.SaveKind(weights_only=False, export_dtype=None, blocking=True), time.perf_counter())
        return commit.step_dir(self.root, step)

    def save_seed(self) -> None:
        """`create_seed_checkpoint`: the freshly initialized weights as step 0, model only.
        A later multi-process run in the same folder starts from it (any mesh: DCP reshards)."""
        self._save(0, policy.SEED_SAVE, time.perf_counter())

    def wait(self) -> None:
        """Block until the in-flight async save (if any) finished, then commit it."""
        if self._pending is not None:
            self._finish(self._pending)

    def close(self) -> None:
        """Wait for the in-flight save, release the saver (threads, stager, writer process)
        and finish the background deletes."""
        try:
            self.wait()
        finally:
            self.saver.close()
            if self.housekeeper is not None:
                self.housekeeper.close()

    def _save(self, step: int, kind: policy.SaveKind, started: float) -> None:
        state = self.contents.weights_state(kind.export_dtype) if kind.weights_only else self.contents.training_state()
        record = self._record(step, state, kind)
        path = self._prepare_folder(step)
        self._saved_steps.add(step)
        if kind.blocking:
            with _save_errors(path):
                self.saver.blocking_save(state, path)
            self._commit(step, path, record, time.perf_counter() - started)
        else:
            future = self.saver.save(state, path)
            self._pending = _PendingSave(step, path, record, future, started)
            logger.info(f"checkpoint: step {step} staged in {time.perf_counter() - started:.2f} s, writing {path} in the background ({self.cfg.async_mode})")

    def _poll(self) -> None:
        """Commit an async save as soon as it is done, without waiting: a crash a few steps
        later should not cost a checkpoint that was already fully written."""
        if self._pending is not None and self._pending.future.done():
            self._finish(self._pending)

    def _finish(self, pending: _PendingSave) -> None:
        self._pending = None
        with _save_errors(pending.path):
            pending.future.result()
        self._commit(pending.step, pending.path, pending.record, time.perf_counter() - pending.started)

    def _commit(self, step: int, path: Path, record: commit.CommitRecord, seconds: float) -> None:
        """Rank 0 only: record the shards' checksums and write the marker, then retire what
        retention lets go. Other ranks have nothing to do: their part of the save is in the
        folder already (DCP finished)."""
        if self.rank != 0:
            return
        record.checksums = integrity.collect(path)
        commit.write_commit(path, record)
        for sidecar in integrity.sidecars(path):  # merged into commit.json now
            self.housekeeper.delete(sidecar)
        logger.info(f"checkpoint: step {step} committed to {path} ({seconds:.2f} s{', model weights only' if record.model_weights_only else ''})")
        if policy.is_export(record):
            return  # an export must not push the newest resumable checkpoint out of retention
        inventory = commit.scan(self.root)
        in_flight = {self._pending.step} if self._pending is not None else set()
        victims = policy.retention_victims(inventory.complete, self.cfg.keep_latest_k, step)
        debris = policy.stale_incomplete(inventory.incomplete, step)
        for old in victims + debris:
            if old != step and old not in in_flight:  # never the newest commit or a save in flight
                self._retire(old)
        if victims:
            logger.info(f"checkpoint: removed step(s) {', '.join(map(str, victims))} (keep_latest_k {self.cfg.keep_latest_k})")

    def _retire(self, step: int) -> None:
        """Un-commit and move a step folder aside now; delete it in the background."""
        retired = commit.retire(self.root, step)
        if retired is not None:
            self.housekeeper.delete(retired)

    def _prepare_folder(self, step: int) -> Path:
        """Rank 0 clears the target folder (retiring it: un-commit, then move aside) before
        DCP writes into it. No barrier needed: other ranks write shards only after DCP's
        planning collective, which rank 0 joins after this returns."""
        path = commit.step_dir(self.root, step)
        if self.rank == 0 and path.exists():
            if path.is_dir() and commit.read_commit(path) is not None:
                logger.warning(f"checkpoint: overwriting the existing checkpoint {path}")
            self._retire(step)
        return path

    def _record(self, step: int, state: dict[str, Any], kind: policy.SaveKind) -> commit.CommitRecord:
        return commit.CommitRecord(
            step=step,
            fingerprint=self.fingerprint,
            contents=sorted(state),
            model_weights_only=kind.weights_only,
            export_dtype=kind.export_dtype,
            model_args=self.model_args,
            world_size=self.world_size,
            mesh=self.contents.mesh(),
            tokens_seen=self.contents.tokens_seen(),
            tokenizer=self.tokenizer,
        )


def _save_errors(path: Path) -> contextlib.AbstractContextManager:
    """A failed save is one line (DCP raises CheckpointException, a BaseException), except a
    collective whose peer died or hung inside DCP: that stays the trainer's collective-failure
    line and exit code, so the launcher names the rank that failed first, not this one."""
    return user_errors(f"checkpoint: saving {path} failed", keep=collective_failure)
