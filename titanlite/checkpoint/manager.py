"""The checkpoint manager: the trainer's policy on top of the one save pipeline.

`checkpointer.Checkpointer` is the mechanism (async save, the commit protocol, checksums,
retention, housekeeping), shared with library users. The manager adds what a run decides:
when to save and what kind of save it is (`policy.py`), what a checkpoint holds
(`contents.py`: model, optimizer, lr schedule, data position, train state) and what its
commit record says (the model's fingerprint, the layout, tokens seen, the tokenizer);
loading is `restore.py`'s, which checks those records before any tensor is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from titanlite.checkpoint import lora_export, commit, hf_io, integrity, policy
from titanlite.checkpoint.async_save import Saver
from titanlite.checkpoint.checkpointer import Checkpointer
from titanlite.checkpoint.contents import Contents
from titanlite.checkpoint.restore import Restorer
from titanlite.config.dtypes import torch_dtype
from titanlite.logging import logger

if TYPE_CHECKING:
    from titanlite.config import Checkpoint
    from titanlite.model_spec import ModelSpec


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
        lora: Any = None,
    ):
        self.cfg = cfg
        self.root = Path(dump_folder) / cfg.folder
        self.model_args = commit.args_dict(model_args)
        self.lora = lora  # the [lora] section of a LoRA run, else None
        adapters_only = lora is not None and lora.save == "adapters"
        self.contents = Contents(model, optimizer, lr_scheduler, dataloader, train_state, adapters_only)
        self.pipeline = Checkpointer(self.root, async_mode=cfg.async_mode, keep_latest_k=cfg.keep_latest_k)
        # `tokenizer` (anything with .path and .vocab_size): recorded, and compared on resume.
        self.tokenizer = (
            integrity.tokenizer_record(tokenizer) if tokenizer is not None and self.pipeline.rank == 0 else {}
        )
        self.tokenizer_path = Path(tokenizer.path) if tokenizer is not None else None
        self.restorer = Restorer(
            cfg, self.root, spec, flavor, model_args, self.contents, self.pipeline.group, self.tokenizer
        )

    @property
    def saver(self) -> Saver:
        return self.pipeline.saver

    def load(self) -> None:
        """Resume, or initialize the model from `initial_load_path` (see `restore.py`)."""
        self.restorer.load()

    def save(self, step: int, last: bool) -> None:
        """Called after every step: commit a finished async save, and start a save when
        `policy.should_save` says so, as `policy.save_kind` says. At most one save is in
        flight: a new one first waits for the previous."""
        self.pipeline.poll()
        if last and self.cfg.last_save_in_hf:
            self.pipeline.wait()  # an async save in flight runs DCP's collectives on the same group
            self.save_hf(step)
        due = self.cfg.enable_checkpoint and policy.should_save(step, self.cfg.interval, last)
        if due and step not in self.pipeline.saved_steps:
            self.pipeline.wait()
            self._save(step, policy.save_kind(self.cfg, last))

    def save_now(self, step: int) -> Path:
        """A blocking save of the whole training state at `step` (a preemption), after the
        save in flight; nothing new when this run saved `step` already. Returns its folder."""
        self.pipeline.wait()
        if step not in self.pipeline.saved_steps:
            self._save(step, policy.SaveKind(weights_only=False, export_dtype=None, blocking=True))
        return commit.step_dir(self.root, step)

    def save_hf(self, step: int) -> Path:
        """`last_save_in_hf`: the model as a Hugging Face folder `<root>/step-N-hf` (not a
        checkpoint to resume from: `commit.scan` lists only `step-N`), every rank writing
        its own shards (`hf_io.save_hf_weights`); a LoRA run's adapters as a PEFT folder, or
        merged into the weights (`lora_export`, by lora.save). Blocking and collective."""
        out = self.root / f"step-{step}-hf"
        extra = hf_io.tokenizer_files(self.tokenizer_path) if self.tokenizer_path is not None else []
        spec, args, dtype = self.restorer.spec, self.restorer.model_args, torch_dtype(self.cfg.export_dtype)
        state, group, lora = self.contents.model_state(), self.pipeline.group, self.lora
        if lora is not None and lora.save == "adapters":
            base = self.cfg.initial_load_path if self.cfg.initial_load_format == "hf" else ""
            lora_export.save_peft_adapter(
                state, out, spec.hf_adapter, args, lora, group=group, dtype=dtype, base_model=base
            )
            logger.info(f"checkpoint: step {step}'s LoRA adapters written as a PEFT folder {out}")
            return out
        if lora is not None:
            state = lora_export.merged_state(state, lora.alpha / lora.rank)
        hf_io.save_hf_weights(state, out, spec.hf_adapter, args, group, dtype, extra)
        logger.info(f"checkpoint: step {step} written as a Hugging Face folder {out}")
        return out

    def save_seed(self) -> None:
        """`create_seed_checkpoint`: the freshly initialized weights as step 0, model only.
        A later multi-process run in the same folder starts from it (any mesh: DCP reshards)."""
        self._save(0, policy.SEED_SAVE)

    def wait(self) -> None:
        """Block until the in-flight async save (if any) finished, then commit it."""
        self.pipeline.wait()

    def close(self) -> None:
        """Wait for the in-flight save, release the saver (threads, stager, writer process)
        and finish the background deletes."""
        self.pipeline.close()

    def _save(self, step: int, kind: policy.SaveKind) -> None:
        state = self.contents.weights_state(kind.export_dtype) if kind.weights_only else self.contents.training_state()
        record = commit.CommitRecord(
            step=step,
            fingerprint=self.restorer.fingerprint,
            contents=sorted(state),
            model_weights_only=kind.weights_only,
            export_dtype=kind.export_dtype,
            model_args=self.model_args,
            world_size=self.pipeline.world_size,
            mesh=self.contents.mesh(),
            tokens_seen=int(getattr(self.contents.train_state, "tokens_seen", 0)),
            tokenizer=self.tokenizer,
        )
        self.pipeline.save_state(step, state, record, kind.blocking)
