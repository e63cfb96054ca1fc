"""How a checkpoint's bytes reach the disk: one small strategy per `checkpoint.async_mode`.

Each strategy turns (state_dict, folder) into a Future that resolves, on this rank, when
DCP's whole save has finished, `.metadata` included. That is the property the commit
protocol relies on: DCP's coordinator (rank 0) writes `.metadata` only after it gathered
every rank's write results, so on rank 0 "my future resolved" means "every rank's shards
and the index are on disk", with no barrier needed.

- "disabled": `dcp.save` in the caller; the loop waits for the full write.
- "async": `dcp.async_save` with DCP's thread executor: a thread plans and writes.
- "async_with_pinned_mem": DCP's process executor: staging buffers in shared memory (pinned,
  with non-blocking copies, when CUDA exists), then a separate daemon process (spawned once,
  its own gloo group) serializes and writes, so the trainer's Python thread and GIL never
  do the write.

Both async strategies stage (copy the state off the live tensors) in the background too,
into buffers a `DefaultStager` keeps across saves, so `save` returns after handing the state
over and the loop's stall is not the copy (which was most of it: ~13% of a blocking save,
into fresh, page-faulting memory each time), and copy with the GIL released
(`GilFreeStateDictStager`). The live tensors change only in an optimizer
step, so `StepGate` holds every optimizer step until the pending copy is done; the copy
overlaps the next forward and backward and the loop never waits unless a step comes first.
Each async strategy's collectives run on a dedicated gloo group so they never interleave
with training collectives.

The test hook `TITANLITE_TEST_SLOW_WRITE_S` makes every rank's writer pause after writing
its shards and before reporting back, which holds a save in flight long enough for a test
to kill a rank mid-save. Nothing else reads it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from titanlite.checkpoint.integrity import ChecksummingWriter
from titanlite.logging import logger

SLOW_WRITE_ENV = "TITANLITE_TEST_SLOW_WRITE_S"


def make_storage_writer(path: str | os.PathLike) -> ChecksummingWriter:
    """DCP's file-system writer (one file per rank, fsync'd) that checksums what it wrote
    (`integrity.py`); under the test hook, one that then pauses before reporting its shards
    written, so the checkpoint stays without `.metadata` and commit marker that long."""
    return ChecksummingWriter(path, delay_s=float(os.environ.get(SLOW_WRITE_ENV) or 0))


class Saver:
    """Blocking saves ("disabled"); the base of the async strategies."""

    def __init__(self, process_group: dist.ProcessGroup | None):
        self.process_group = process_group

    def save(self, state_dict: dict[str, Any], path: str | os.PathLike) -> Future:
        dcp.save(state_dict, storage_writer=make_storage_writer(path), process_group=self.process_group)
        done: Future = Future()
        done.set_result(None)
        return done

    def blocking_save(self, state_dict: dict[str, Any], path: str | os.PathLike) -> None:
        """A save the caller waits for (seed, last step), whatever the mode."""
        Saver.save(self, state_dict, path)

    def close(self) -> None:
        """Release what the strategy holds; the manager waits for in-flight saves first."""


class StepGate:
    """Holds optimizer steps until a background staging copy has read the tensors.

    A global optimizer step pre-hook (torch.optim's `register_optimizer_step_pre_hook`), so
    it covers whatever optimizer the trainer steps; installed at the first save, removed at
    close (not from inside the hook: torch iterates the hook dict while calling it)."""

    def __init__(self) -> None:
        self._staged: Future | None = None
        self._hook: RemovableHandle | None = None
        self.held_s = 0.0  # total time steps waited here: part of the loop's stall (the bench adds it)

    def hold_until(self, staged: Future) -> None:
        self._staged = staged
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(self._wait)

    def _wait(self, *_: Any) -> None:
        """Block until the copy is done; its failure, if any, is the save's to report."""
        if self._staged is not None:
            staged, self._staged = self._staged, None
            started = time.perf_counter()
            wait([staged])
            self.held_s += time.perf_counter() - started

    def close(self) -> None:
        self._wait()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class BackgroundStager:
    """A `DefaultStager` that copies in its own thread into buffers reused by every save.

    torch 2.11's DefaultStager empties its copier after every stage (a fix for a reference
    cycle; 2.13 moved that to close()), so there a stager stages only once and every save
    needs a new one; 2.13's keeps its staging buffers across saves."""

    def __init__(self, shared_memory: bool):
        self.shared_memory = shared_memory
        self.gate = StepGate()
        self.stager = self._new_stager()

    def _new_stager(self) -> DefaultStager:
        gpu = torch.cuda.is_available()
        # Pinning and non-blocking copies need CUDA; shared memory lets a writer process
        # read the staged tensors without another copy; use_async_staging (its default, True
        # in torch 2.11 and 2.13) copies in the stager's own thread.
        options = StagingOptions(use_pinned_memory=gpu, use_shared_memory=self.shared_memory, use_non_blocking_copy=gpu)
        stager = DefaultStager(options)
        if isinstance(getattr(stager, "_state_dict_stager", None), StateDictStager):
            stager._state_dict_stager = GilFreeStateDictStager(pin_memory=gpu, share_memory=self.shared_memory)
        return stager

    def usable(self) -> DefaultStager:
        inner = getattr(self.stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self.stager.close()
            self.stager = self._new_stager()
        return self.stager

    def close(self) -> None:
        self.gate.close()
        self.stager.close()


class GilFreeStateDictStager(StateDictStager):
    """DCP's state-dict copier, with the copy into its reused buffers done by `Tensor.copy_`.

    DCP copies each storage with `UntypedStorage.copy_`, whose binding holds the GIL for the
    whole memcpy (measured on torch 2.13: a 80 MB copy kept every other Python thread out
    for its 30 ms), so a background copy stopped the trainer's thread, kernel launches and
    all. `Tensor.copy_` releases the GIL. The first save of each storage still goes through
    DCP (allocating shared or pinned memory is its business); every later save reuses the
    buffer and copies through uint8 views of the two storages."""

    def _stage_untyped_storage(self, storage: torch.UntypedStorage, non_blocking: bool = False) -> torch.UntypedStorage:
        staged = self._cached_storage_mapping.get(storage)
        if staged is None or staged.size() != storage.size():
            return super()._stage_untyped_storage(storage, non_blocking=non_blocking)
        _bytes_of(staged).copy_(_bytes_of(storage), non_blocking=non_blocking)
        return staged


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ThreadSaver(Saver):
    """The "async" mode: DCP's thread executor, staging in the background."""

    shared_memory = False
    executor = AsyncCheckpointerType.THREAD

    def __init__(self, process_group: dist.ProcessGroup | None):
        super().__init__(process_group)
        self.staging = BackgroundStager(self.shared_memory)

    def save(self, state_dict: dict[str, Any], path: str | os.PathLike) -> Future:
        response = dcp.async_save(
            state_dict,
            storage_writer=make_storage_writer(path),
            process_group=self.process_group,
            async_checkpointer_type=self.executor,
            async_stager=self.staging.usable(),
        )
        self.staging.gate.hold_until(response.staging_completion)
        return response.upload_completion

    def close(self) -> None:
        self.staging.close()


class ProcessSaver(ThreadSaver):
    """The "async_with_pinned_mem" mode: DCP's process executor, staging into shared memory."""

    shared_memory = True
    executor = AsyncCheckpointerType.PROCESS

    def close(self) -> None:
        """Also end DCP's writer daemon now rather than at interpreter exit, so a trainer that
        finished does not keep a process (and its gloo group) alive behind it.

        DCP keeps the daemon in a private module global and stops it only from `__del__` or at
        exit; this reaches that global (present in torch 2.11 and 2.13) and does what `__del__`
        does. If a later torch renames it, the daemon still ends at exit (daemon=True).
        """
        from torch.distributed.checkpoint import _async_process_executor as executor

        super().close()
        if (process := getattr(executor, "_CHECKPOINT_PROCESS", None)) is None:
            return
        try:
            process.__del__()
        except Exception as error:  # a dead daemon is what we wanted anyway
            logger.warning(f"checkpoint: stopping the checkpoint writer process: {error}")
        executor._CHECKPOINT_PROCESS = None


def build_saver(mode: str, process_group: dist.ProcessGroup | None) -> Saver:
    """The strategy for `checkpoint.async_mode` (config/sections.py's choices validated the name)."""
    return {"disabled": Saver, "async": ThreadSaver, "async_with_pinned_mem": ProcessSaver}[mode](process_group)
