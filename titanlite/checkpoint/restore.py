"""Loading: resume a run from its own checkpoint, or start it from other weights.

`Restorer.load` does one of three things, in this order of preference:

- resume from `<dump_folder>/<checkpoint.folder>` (the newest complete step, or
  `load_step`; `policy.choose_resume` decides): the whole training state, or only the
  model when that step is the step-0 seed checkpoint;
- when that folder holds none, initialize the model from `initial_load_path`: any DCP
  folder (model weights only, at top level or under "model.") or a Hugging Face folder;
- else nothing: the run starts from its initialized weights.

Everything a user can get wrong is checked on rank 0 before any collective load starts
and reaches every rank as the same one line (`parallel.collectives.on_rank0`): the model
fingerprint, the tokenizer a resumed run was trained with, that every shard file the DCP
index names is there and long enough, the tensor shapes, a Hugging Face config.json that
describes another model. Then the ranks verify the shards' recorded checksums, each a
share of the files (`integrity.verify`): a shard corrupted inside its data is one line
naming the file. A shard that fails to deserialize is reported by DCP on every rank and
becomes one line too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from titanlite.checkpoint import hf_io, integrity, policy
from titanlite.checkpoint.commit import CommitRecord, args_dict, dcp_tensors, fingerprint, read_dcp_index
from titanlite.checkpoint.contents import Contents
from titanlite.checkpoint.load_progress import ProgressReader
from titanlite.checkpoint.train_state import RNG_PREFIX
from titanlite.errors import TitanliteError, user_errors
from titanlite.logging import logger
from titanlite.parallel.collectives import any_rank, on_rank0, raise_first
from titanlite.parallel.optim_state import group_entries, regrouped, unsaved_group_setting

if TYPE_CHECKING:
    from titanlite.config import Checkpoint
    from titanlite.model_spec import ModelSpec


class Restorer:
    """Loads a checkpoint, or initial weights, into one run's live objects (see module doc).
    Every rank builds one and calls `load`; `group` None is one process without
    torch.distributed."""

    def __init__(
        self,
        cfg: Checkpoint,
        root: Path,
        spec: ModelSpec,
        flavor: str,
        model_args: Any,
        contents: Contents,
        group: dist.ProcessGroup | None,
        tokenizer: dict[str, Any] | None = None,
    ):
        self.cfg, self.root = cfg, root
        self.tokenizer = tokenizer or {}  # integrity.tokenizer_record of this run (rank 0)
        self.spec, self.model_args = spec, model_args
        self.fingerprint = fingerprint(spec.name, flavor, model_args)
        self.contents, self.group = contents, group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1

    def load(self) -> None:
        """Resume from `<dump_folder>/<folder>` (newest complete, or `load_step`); when that
        holds no checkpoint, initialize the model from `initial_load_path`; else do nothing."""
        if self.cfg.enable_checkpoint:
            choice = on_rank0(self.group, lambda: policy.choose_resume(self.root, self.cfg.load_step))
            if self.rank == 0:  # one line, not one per rank
                for note in choice.notes:
                    logger.warning(note)
            if choice.step is not None:
                if self.contents.adapters_only and not choice.record.model_weights_only:
                    self._load_initial()  # a LoRA run's frozen weights are not in its checkpoints
                self._resume(choice)
                return
        self._load_initial()

    def _load_initial(self) -> None:
        """The model from `initial_load_path` (its adapters, if any, keep their init)."""
        if self.cfg.initial_load_path:
            initialize = self._load_hf if self.cfg.initial_load_format == "hf" else self._load_initial_dcp
            initialize(Path(self.cfg.initial_load_path))

    def _resume(self, choice: policy.LoadChoice) -> None:
        path, record = choice.path, choice.record

        def check() -> Metadata:
            if not record.model_weights_only:  # the seed's weights are an init: any tokenizer of its vocab size
                check_tokenizer(path, record, self.tokenizer)
            check_model(path, record, self.fingerprint, self.model_args)
            return read_checked_metadata(path)

        metadata = on_rank0(self.group, check)
        started = time.perf_counter()
        integrity.verify(path, record.checksums, self.group)
        if record.model_weights_only:  # the step-0 seed: weights only, training starts at 0
            self._load_model_dcp(path, prefix="model.")
            _initialized(f"the seed checkpoint {path}", started)
            return
        state = self.contents.training_state()
        missing_rng = self._drop_missing_rng(state, metadata)
        keys = metadata.state_dict_metadata
        raise_first(self.group, unsaved_group_setting(path, state["optimizer"], keys, prefix="optimizer."))
        groups = group_entries(state["optimizer"])
        dcp_load(state, path, self.group)
        raise_first(self.group, regrouped(path, groups, state["optimizer"]))
        self.contents.apply_training_state(state)
        layout = f"world size {record.world_size}{_mesh_text(record.mesh)}"
        now = f"world size {self.world_size}{_mesh_text(self.contents.mesh())}"
        logger.info(
            f"checkpoint: resumed from {path} at step {record.step} ({time.perf_counter() - started:.2f} s); "
            f"saved at {layout}, loaded at {now}; data stream position {_short(state['dataloader'])}"
        )
        if missing_rng and self.rank == 0:
            logger.warning(
                f"checkpoint: {path} has no RNG state for ranks >= {record.world_size} (saved at world size "
                f"{record.world_size}); they keep their seeded RNG"
            )

    def _drop_missing_rng(self, state: dict[str, Any], metadata: Metadata) -> bool:
        """Leave out this rank's RNG entries the checkpoint lacks (saved at a smaller world
        size, or without CUDA); DCP would otherwise fail on the missing key. Returns
        whether any rank found no RNG state at all (collective: every rank calls it)."""
        train_state, none_saved = state["train_state"], False
        for key in [k for k in train_state if k.startswith(RNG_PREFIX)]:
            rng = train_state[key]
            for device in [d for d in rng if f"train_state.{key}.{d}" not in metadata.state_dict_metadata]:
                del rng[device]
            if not rng:
                del train_state[key]
                none_saved = True
        return any_rank(self.group, none_saved)

    def _load_initial_dcp(self, given: Path) -> None:
        """`initial_load_path` (dcp): model weights only, from any DCP folder or our root."""

        def check() -> tuple[Path, str, dict[str, str]]:
            path, record = policy.resolve_initial_load(given)
            metadata = read_checked_metadata(path)
            prefix = "model." if any(k.startswith("model.") for k in metadata.state_dict_metadata) else ""
            saved = {k[len(prefix) :]: tuple(v.size) for k, v in dcp_tensors(metadata, prefix).items()}
            check_tensor_shapes(path, saved, self.contents.model_shapes())
            return path, prefix, record.checksums if record is not None else {}

        path, prefix, checksums = on_rank0(self.group, check)
        started = time.perf_counter()
        integrity.verify(path, checksums, self.group)
        self._load_model_dcp(path, prefix, base=True)
        _initialized(str(path), started)

    def _load_model_dcp(self, path: Path, prefix: str, base: bool = False) -> None:
        """Model weights only; `prefix` "" reads checkpoints that keep weights at top level
        (torchtitan's seed and weights-only exports do); `base`: initial weights, no adapters."""
        model_sd = self.contents.model_state(base)
        dcp_load({"model": model_sd} if prefix else model_sd, path, self.group)
        self.contents.set_model_state(model_sd, base)

    def _load_hf(self, folder: Path) -> None:
        """`initial_load_path` (hf): rank 0 checks the folder (config.json, the index's
        files, every tensor's shape); then each rank reads only the slices of its own
        shards through DCP's Hugging Face reader (`hf_io.load_hf_weights`)."""
        adapter = self.spec.hf_adapter
        if adapter is None:
            raise TitanliteError(f"checkpoint.initial_load_format: model {self.spec.name} has no Hugging Face mapping")

        def check() -> None:  # against the whole model's shapes: a pipeline stage holds only its layers
            wanted = hf_io.whole_model_shapes(self.spec.model_class, self.model_args)
            hf_io.check_hf_folder(folder, adapter, self.model_args, wanted)

        on_rank0(self.group, check)
        started = time.perf_counter()
        model_sd = self.contents.model_state(base=True)
        hf_io.load_hf_weights(model_sd, folder, adapter, self.model_args, self.group)
        self.contents.set_model_state(model_sd, base=True)
        _initialized(f"Hugging Face weights {folder}", started)


def _initialized(source: str, started: float) -> None:
    logger.info(f"checkpoint: initialized the model from {source} ({time.perf_counter() - started:.2f} s)")


def dcp_load(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    """dcp.load in place, with progress lines, and errors (a bad shard on any rank reaches
    every rank through DCP's own gather) turned into one line naming the folder. `group`
    None: one process."""
    with user_errors(f"{path}: cannot load checkpoint"):
        dcp.load(state, storage_reader=ProgressReader(path), process_group=group, no_dist=group is None)


def read_checked_metadata(path: Path) -> Metadata:
    """DCP's index of `path`, after checking every shard file it names is there and long
    enough: a truncated or missing shard becomes one line naming the file, before any
    collective load starts."""
    metadata = read_dcp_index(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        if (relative := getattr(info, "relative_path", None)) is not None:
            needed[relative] = max(needed.get(relative, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        shard = path / relative
        if not shard.is_file():
            raise TitanliteError(f"{shard}: shard file missing from the checkpoint")
        if (actual := shard.stat().st_size) < size:
            raise TitanliteError(f"{shard}: shard is truncated ({actual} bytes, the checkpoint index needs {size})")
    return metadata


def check_tokenizer(path: Path, record: CommitRecord, current: dict[str, Any]) -> None:
    """A resumed run must tokenize as the run that saved it did: the same vocabulary size,
    and the same tokenizer file (by checksum). Records without a tokenizer are not checked."""
    if not (saved := record.tokenizer) or not current:
        return
    if saved.get("vocab_size") != current["vocab_size"]:
        difference = f"its vocabulary has {current['vocab_size']} tokens, the checkpoint's {saved.get('vocab_size')}"
    elif saved.get("crc32") and current["crc32"] and saved["crc32"] != current["crc32"]:
        difference = f"CRC-32 {current['crc32']}, the checkpoint's {saved['crc32']}"
    else:
        return
    raise TitanliteError(
        f"model.tokenizer_path: {current['path']} is not the tokenizer {path} was trained with "
        f"({saved.get('path')}): {difference}"
    )


def check_model(path: Path, record: CommitRecord, built: dict[str, str], model_args: Any) -> None:
    """The checkpoint is of the model this run builds (`built`, `commit.fingerprint`): the same
    model, flavor and hyperparameters. Shapes alone would let a tied flavor load an untied
    one's weights (both tables have the same shape) without a word."""
    if record.fingerprint != built:
        raise TitanliteError(
            f"{path}: checkpoint is of {_describe(record.fingerprint, record.model_args)}, "
            f"but this run builds {_describe(built, args_dict(model_args))}"
        )


def check_tensor_shapes(path: Path, saved: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the model wants is in the checkpoint, at the same global shape."""
    if missing := [k for k in wanted if k not in saved]:
        raise TitanliteError(
            f"{path}: the checkpoint lacks {len(missing)} of the model's tensors (first: {missing[0]})"
        )
    for key, shape in wanted.items():
        if tuple(saved[key]) != tuple(shape):
            raise TitanliteError(
                f"{path}: tensor {key} has shape {list(saved[key])} in the checkpoint but {list(shape)} in this model"
            )


# The experts' dims (parallel/mesh.py): ranks borrowed from dp_shard x cp, shown apart from the mesh they split.
_EXPERT_DIMS = ("efsdp", "ep")


def _mesh_text(mesh: dict[str, int]) -> str:
    """` (mesh dp_shard 4 x tp 2; experts efsdp 2 x ep 2)`, or '' for no mesh."""

    def dims(experts: bool) -> str:
        return " x ".join(f"{k} {v}" for k, v in mesh.items() if (k in _EXPERT_DIMS) == experts)

    return f" (mesh {dims(False)}{f'; experts {dims(True)}' if dims(True) else ''})" if mesh else ""


def _describe(saved_fingerprint: dict[str, Any], args: dict[str, Any]) -> str:
    text = f"model {saved_fingerprint.get('name')} flavor {saved_fingerprint.get('flavor')}"
    return text + (f" ({_short(args, 160)})" if args else "")


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
