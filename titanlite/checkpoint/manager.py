"""The checkpoint mechanism: what state goes into a DCP checkpoint, and how it is saved,
committed, found and loaded again. The rules (when, which, how many) are in `policy.py`;
how bytes reach the disk per `async_mode` is in `async_save.py`.

What one checkpoint holds (top-level DCP keys):

- "model", "optimizer": `get_model_state_dict` / `get_optimizer_state_dict`: this rank's
  DTensor shards, never gathered. DCP records each shard's place in the global tensor,
  which is what lets a checkpoint load at another mesh (resharding).
- "lr_scheduler", "train_state" (step, tokens seen: identical on every rank, one copy;
  plus `rng_rank{r}`: each rank's RNG state under its own key).
- "dataloader": the loader's state under one common key. By design it is identical on
  every rank (a global stream position that does not depend on the data-parallel degree),
  so DCP writes it once and every rank of any later layout reads the same value.

The commit protocol (see policy.py for the layout): rank 0 writes `commit.json` once its
own DCP save finished. For DCP that means the coordinator already gathered every rank's
write results and wrote `.metadata`, so no barrier is needed, and an async save costs no
synchronisation at all: rank 0 checks its future at each `save` call (every step) and at
`close`, and commits as soon as it resolved without error. A rank dying mid-save leaves a
folder without `commit.json`; discovery skips it and the previous checkpoint stays newest.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titanlite.checkpoint import policy
from titanlite.checkpoint.async_save import ASYNC_MODES, Saver, build_saver
from titanlite.checkpoint.train_state import RNG_PREFIX
from titanlite.errors import TitanliteError
from titanlite.logging import logger
from titanlite.dtypes import DTYPES

T = TypeVar("T")


@dataclass
class _PendingSave:
    """The one async save that may be in flight."""

    step: int
    path: Path
    record: policy.CommitRecord
    future: Future
    started: float


class CheckpointManager:
    """Saves, commits, retains and loads the training state of one run (see module doc)."""

    def __init__(
        self,
        checkpoint_cfg: Any,
        *,
        dump_folder: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        dataloader: Any,
        train_state: Any,
        model_fingerprint: dict[str, Any],
        spec: Any,
        model_args: Any,
    ):
        if checkpoint_cfg.async_mode not in ASYNC_MODES:
            raise TitanliteError(f"checkpoint.async_mode: {checkpoint_cfg.async_mode!r} is not one of {', '.join(ASYNC_MODES)}")
        self.cfg = checkpoint_cfg
        self.root = Path(dump_folder) / checkpoint_cfg.folder
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_state = dataloader, train_state
        self.fingerprint = dict(model_fingerprint)
        self.spec, self.model_args = spec, model_args
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # DCP's own collectives (plans, metadata) run on a dedicated gloo group: async saves
        # need a CPU backend, and a background save must never interleave with the
        # training's NCCL/gloo collectives on the default group. Created once, by all ranks.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.saver: Saver = build_saver(checkpoint_cfg.async_mode, self.group)
        self._pending: _PendingSave | None = None
        self._saved_steps: set[int] = set()  # committed or in flight in this run

    # ---------------------------------------------------------------- saving

    def save(self, step: int, last: bool) -> None:
        """Called after every step: commit a finished async save, and start a save when
        `policy.should_save` says so. At most one save is in flight: a new one first waits
        for the previous. The last step's save is blocking (nothing left to overlap with)."""
        started = time.perf_counter()
        self._poll()
        if not self.cfg.enable_checkpoint or not policy.should_save(step, self.cfg.interval, last):
            return
        if step in self._saved_steps:
            return
        self.wait()
        weights_only = last and self.cfg.model_weights_only
        state = self._weights_state(self.cfg.export_dtype) if weights_only else self._training_state()
        record = self._record(step, state, weights_only)
        path = self._prepare_folder(step)
        self._saved_steps.add(step)
        if last or self.saver.mode == "disabled":
            self.saver.blocking_save(state, path)
            self._commit(step, path, record, time.perf_counter() - started)
        else:
            future = self.saver.save(state, path)
            self._pending = _PendingSave(step, path, record, future, started)
            logger.info(f"checkpoint: step {step} staged in {time.perf_counter() - started:.2f} s, writing {path} in the background ({self.saver.mode})")

    def save_seed(self) -> None:
        """`create_seed_checkpoint`: the freshly initialized weights as step 0, model only.
        A later multi-process run in the same folder starts from it (any mesh: DCP reshards)."""
        state = self._weights_state(None)
        record = self._record(0, state, weights_only=True)
        path = self._prepare_folder(0)
        started = time.perf_counter()
        self.saver.blocking_save(state, path)
        self._commit(0, path, record, time.perf_counter() - started)

    def wait(self) -> None:
        """Block until the in-flight async save (if any) finished, then commit it."""
        if self._pending is not None:
            self._finish(self._pending)

    def close(self) -> None:
        """Wait for the in-flight save and release the saver (threads, stager, writer process)."""
        try:
            self.wait()
        finally:
            self.saver.close()

    def _poll(self) -> None:
        """Commit an async save as soon as it is done, without waiting: a crash a few steps
        later should not cost a checkpoint that was already fully written."""
        if self._pending is not None and self._pending.future.done():
            self._finish(self._pending)

    def _finish(self, pending: _PendingSave) -> None:
        self._pending = None
        try:
            pending.future.result()
        except BaseException as error:  # DCP raises CheckpointException, a BaseException
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            raise TitanliteError(f"checkpoint: saving {pending.path} failed: {_one_line(error)}") from None
        self._commit(pending.step, pending.path, pending.record, time.perf_counter() - pending.started)

    def _commit(self, step: int, path: Path, record: policy.CommitRecord, seconds: float) -> None:
        """Rank 0 only: write the marker, then apply retention. Other ranks have nothing to
        do: their part of the save is in the folder already (DCP finished)."""
        if self.rank != 0:
            return
        policy.write_commit(path, record)
        logger.info(f"checkpoint: step {step} committed to {path} ({seconds:.2f} s{', model weights only' if record.model_weights_only else ''})")
        if record.model_weights_only and step > 0:
            return  # an export must not push the newest resumable checkpoint out of retention
        inventory = policy.scan(self.root)
        victims = policy.retention_victims(inventory.complete, self.cfg.keep_latest_k, step)
        debris = policy.stale_incomplete(inventory.incomplete, step)
        for old in victims + debris:
            policy.remove_checkpoint(self.root, old)
        if victims:
            logger.info(f"checkpoint: removed step(s) {', '.join(map(str, victims))} (keep_latest_k {self.cfg.keep_latest_k})")

    def _prepare_folder(self, step: int) -> Path:
        """Rank 0 empties the target folder (un-committing first) before DCP writes into it.
        No barrier needed: other ranks write shards only after DCP's planning collective,
        which rank 0 joins after this returns."""
        path = policy.step_dir(self.root, step)
        if self.rank == 0 and path.exists():
            if policy.read_commit(path) is not None:
                logger.warning(f"checkpoint: overwriting the existing checkpoint {path}")
            policy.remove_checkpoint(self.root, step)
        return path

    def _training_state(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "dataloader": self.dataloader.state_dict(),
            "train_state": self.train_state.state_dict(),
        }

    def _weights_state(self, dtype: str | None) -> dict[str, Any]:
        model_sd = get_model_state_dict(self.model)
        if dtype is not None:
            target = DTYPES[dtype]
            model_sd = {k: v.to(target) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in model_sd.items()}
        return {"model": model_sd}

    def _record(self, step: int, state: dict[str, Any], weights_only: bool) -> policy.CommitRecord:
        return policy.CommitRecord(
            step=step,
            fingerprint=self.fingerprint,
            contents=sorted(state),
            model_weights_only=weights_only,
            export_dtype=self.cfg.export_dtype if weights_only and step > 0 else None,
            model_args=self._args_dict(),
            world_size=self.world_size,
            mesh=_mesh_of(self.model),
            tokens_seen=int(getattr(self.train_state, "tokens_seen", 0)),
        )

    # --------------------------------------------------------------- loading

    def load(self) -> None:
        """Resume from `<dump_folder>/<folder>` (newest complete, or `load_step`); when that
        holds no checkpoint, initialize the model from `initial_load_path`; else do nothing."""
        if self.cfg.enable_checkpoint:
            choice = self._on_rank0(lambda: policy.choose_resume(self.root, self.cfg.load_step))
            if self.rank == 0:  # one line, not one per rank
                for note in choice.notes:
                    logger.warning(note)
            if choice.step is not None:
                self._resume(choice)
                return
        if self.cfg.initial_load_path:
            if self.cfg.initial_load_format == "hf":
                self._load_hf(Path(self.cfg.initial_load_path))
            else:
                self._load_initial_dcp(Path(self.cfg.initial_load_path))

    def _resume(self, choice: policy.LoadChoice) -> None:
        path, record = choice.path, choice.record

        def check() -> Metadata:
            saved = record.fingerprint
            if saved != self.fingerprint:
                raise TitanliteError(f"{path}: checkpoint is of {_describe(saved, record.model_args)}, but this run builds {_describe(self.fingerprint, self._args_dict())}")
            return _read_checked_metadata(path)

        metadata = self._on_rank0(check)
        started = time.perf_counter()
        if record.model_weights_only:  # the step-0 seed: weights only, training starts at 0
            self._load_model_dcp(path, prefix="model.")
            logger.info(f"checkpoint: initialized the model from the seed checkpoint {path} ({time.perf_counter() - started:.2f} s)")
            return
        state = self._training_state()
        missing_rng = self._drop_missing(state, metadata)
        self._dcp_load(state, path)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.dataloader.load_state_dict(state["dataloader"])
        self.train_state.load_state_dict(state["train_state"])
        layout = f"world size {record.world_size}{_mesh_text(record.mesh)}"
        now = f"world size {self.world_size}{_mesh_text(_mesh_of(self.model))}"
        logger.info(
            f"checkpoint: resumed from {path} at step {record.step} ({time.perf_counter() - started:.2f} s); "
            f"saved at {layout}, loaded at {now}; data stream position {_short(state['dataloader'])}"
        )
        if missing_rng and self.rank == 0:
            logger.warning(f"checkpoint: {path} has no RNG state for ranks >= {record.world_size} (saved at world size {record.world_size}); they keep their seeded RNG")

    def _drop_missing(self, state: dict[str, Any], metadata: Metadata) -> bool:
        """Leave out this rank's RNG entries the checkpoint lacks (saved at a smaller world
        size, or without CUDA); DCP would otherwise fail on the missing key. Returns
        whether any rank found no RNG state at all (collective: every rank calls it)."""
        train_state = state.get("train_state")
        none_saved = False
        if isinstance(train_state, dict):
            for key in [k for k, v in train_state.items() if k.startswith(RNG_PREFIX) and isinstance(v, dict)]:
                rng = train_state[key]
                for device in list(rng):
                    if f"train_state.{key}.{device}" not in metadata.state_dict_metadata:
                        del rng[device]
                if not rng:
                    del train_state[key]
                    none_saved = True
        return self._all_ranks_any(none_saved)

    def _load_initial_dcp(self, given: Path) -> None:
        """`initial_load_path` (dcp): model weights only, from any DCP folder or our root."""

        def check() -> tuple[Path, str]:
            path, record = policy.resolve_initial_load(given)
            metadata = _read_checked_metadata(path)
            prefix = "model." if any(k.startswith("model.") for k in metadata.state_dict_metadata) else ""
            self._check_shapes(path, metadata, prefix)
            return path, prefix

        path, prefix = self._on_rank0(check)
        started = time.perf_counter()
        self._load_model_dcp(path, prefix)
        logger.info(f"checkpoint: initialized the model from {path} ({time.perf_counter() - started:.2f} s)")

    def _load_model_dcp(self, path: Path, prefix: str) -> None:
        """Model weights only; `prefix` "" reads checkpoints that keep weights at top level
        (torchtitan's seed and weights-only exports do)."""
        model_sd = get_model_state_dict(self.model)
        state = {"model": model_sd} if prefix else model_sd
        self._dcp_load(state, path)
        set_model_state_dict(self.model, model_sd)

    def _load_hf(self, folder: Path) -> None:
        """`initial_load_path` (hf): rank 0 reads the safetensors and converts them to our
        names; `set_model_state_dict` with `broadcast_from_rank0` sends each full tensor to
        the other ranks, and every rank keeps only its shard."""
        from titanlite.checkpoint import export

        adapter = self.spec.hf_adapter
        if adapter is None:
            raise TitanliteError(f"checkpoint.initial_load_format: model {self.fingerprint.get('name')} has no Hugging Face mapping")

        def read() -> dict[str, torch.Tensor]:
            full = export.load_hf(folder, adapter, self.model_args)
            _check_tensor_shapes(folder, {k: tuple(v.shape) for k, v in full.items()}, self._model_shapes())
            return full

        started = time.perf_counter()
        full = self._on_rank0(read, broadcast_result=False)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.distributed, strict=True)
        set_model_state_dict(self.model, full if full is not None else {}, options=options)
        logger.info(f"checkpoint: initialized the model from Hugging Face weights {folder} ({time.perf_counter() - started:.2f} s)")

    def _dcp_load(self, state: dict[str, Any], path: Path) -> None:
        """dcp.load with errors (a bad shard on any rank reaches every rank through DCP's
        own gather) turned into one line naming the folder."""
        try:
            dcp.load(state, storage_reader=FileSystemReader(path), process_group=self.group, no_dist=not self.distributed)
        except BaseException as error:
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            raise TitanliteError(f"{path}: cannot load checkpoint: {_one_line(error)}") from None

    def _check_shapes(self, path: Path, metadata: Metadata, prefix: str) -> None:
        saved = {k[len(prefix):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)}
        _check_tensor_shapes(path, saved, self._model_shapes())

    def _model_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in get_model_state_dict(self.model).items() if torch.is_tensor(v)}

    def _args_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.model_args) if dataclasses.is_dataclass(self.model_args) else {}

    # ----------------------------------------------------------- coordination

    def _on_rank0(self, fn: Callable[[], T], broadcast_result: bool = True) -> T:
        """Run a decision on rank 0 only (one view of the file system) and give every rank
        its result, or raise its user error on every rank so all exit alike."""
        result, error = None, None
        if self.rank == 0:
            try:
                result = fn()
            except TitanliteError as e:
                error = str(e)
        if self.distributed and self.world_size > 1:
            payload = [(result if broadcast_result else None, error)]
            dist.broadcast_object_list(payload, src=0, group=self.group)
            if self.rank != 0:
                result = payload[0][0]
                error = payload[0][1]
        if error is not None:
            raise TitanliteError(error)
        return result

    def _all_ranks_any(self, flag: bool) -> bool:
        if not (self.distributed and self.world_size > 1):
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, group=self.group)
        return bool(value.item())


def _read_checked_metadata(path: Path) -> Metadata:
    """DCP's index of `path`, after checking every shard file it names is there and long
    enough: a truncated or missing shard becomes one line naming the file, before any
    collective load starts."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise TitanliteError(f"{path}: not a DCP checkpoint (no {policy.DCP_METADATA_FILE})") from None
    except Exception as error:
        raise TitanliteError(f"{path / policy.DCP_METADATA_FILE}: unreadable checkpoint index ({_one_line(error)})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            needed[relative] = max(needed.get(relative, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        shard = path / relative
        if not shard.is_file():
            raise TitanliteError(f"{shard}: shard file missing from the checkpoint")
        actual = shard.stat().st_size
        if actual < size:
            raise TitanliteError(f"{shard}: shard is truncated ({actual} bytes, the checkpoint index needs {size})")
    return metadata


def _check_tensor_shapes(path: Path, saved: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> None:
    missing = [k for k in wanted if k not in saved]
    if missing:
        raise TitanliteError(f"{path}: the checkpoint lacks {len(missing)} of the model's tensors (first: {missing[0]})")
    for key, shape in wanted.items():
        if tuple(saved[key]) != tuple(shape):
            raise TitanliteError(f"{path}: tensor {key} has shape {list(saved[key])} in the checkpoint but {list(shape)} in this model")


def _mesh_of(model: torch.nn.Module) -> dict[str, int]:
    """The mesh the parameters live on ({} when not distributed), recorded for the log."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            return dict(zip(names, mesh.shape))
    return {}


def _mesh_text(mesh: dict[str, int]) -> str:
    return f" (mesh {' x '.join(f'{k} {v}' for k, v in mesh.items())})" if mesh else ""


def _describe(fingerprint: dict[str, Any], args: dict[str, Any]) -> str:
    text = f"model {fingerprint.get('name')} flavor {fingerprint.get('flavor')}"
    return text + (f" ({_short(args, 160)})" if args else "")


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(error: BaseException) -> str:
    """The root cause of an exception in one line (DCP wraps per-rank failures)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _trace) = sorted(failures.items())[0]
        return f"rank {rank}: {_one_line(inner)}"
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
