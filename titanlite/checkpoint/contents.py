"""What one checkpoint holds, assembled from the run's live objects for a save or a load.

Top-level DCP keys:

- "model", "optimizer": `get_state_dict` (model and optimizer state dicts): this rank's
  DTensor shards, never gathered. DCP records each shard's place in the global tensor,
  which is what lets a checkpoint load at another mesh (resharding). The optimizer's state
  is flattened to one key per parameter (`state.<name>.exp_avg`, `param_groups.<name>.lr`):
  pipeline stages hold different parameters, and a per-parameter key is what each rank of
  any later layout finds its own by (a `param_groups` list would be one rank's list).
- "lr_scheduler", "train_state" (step, tokens seen: identical on every rank, one copy;
  plus `rng_rank{r}`: each rank's RNG state under its own key).
- "dataloader": the loader's state under one common key. By design it is identical on
  every rank (a global stream position that does not depend on the data-parallel degree),
  so DCP writes it once and every rank of any later layout reads the same value.

A weights-only checkpoint (the seed, an export) holds "model" alone. A LoRA run that saves its
adapters only (`adapters_only`, lora.save = "adapters") leaves its frozen weights out of "model"
(and the optimizer holds nothing of them): they are the initial weights, loaded again on resume. The save pipeline
(`manager.py`) and the load side (`restore.py`) both build their state dicts here, so the
two cannot disagree on the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from titanlite.checkpoint.export import cast_floating
from titanlite.config.dtypes import torch_dtype
from titanlite.parallel.float8 import plain_tensors
from titanlite.parallel.lora import is_adapter

FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
STATEFUL = ("lr_scheduler", "dataloader", "train_state")  # saved and restored through their own state_dict


@dataclass
class Contents:
    """The five stateful parts of a run that a checkpoint saves and restores (only the model
    for a weights-only save such as the seed checkpoint)."""

    model: nn.Module
    optimizer: Optimizer | None
    lr_scheduler: LRScheduler | None
    dataloader: Stateful | None
    train_state: Stateful | None
    adapters_only: bool = False

    @property
    def options(self) -> StateDictOptions:
        """How the model and optimizer state dicts are taken and set: flat optimizer keys; the
        frozen weights left out where only the adapters are saved."""
        return StateDictOptions(
            flatten_optimizer_state_dict=True, ignore_frozen_params=self.adapters_only, strict=not self.adapters_only
        )

    def training_state(self) -> dict[str, Any]:
        """The whole training state, as fresh state dicts (to save, or to load into).
        `get_state_dict` builds both after one check of the model (`_verify_options` walks
        every module); the separate model and optimizer calls each did it, inside the loop's
        stall of an async save."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self.options)
        pieces = {name: getattr(self, name).state_dict() for name in STATEFUL}
        return {"model": plain_tensors(model_state), "optimizer": optimizer_state, **pieces}

    def apply_training_state(self, state: dict[str, Any]) -> None:
        """Put a loaded `training_state()` back into the live objects."""
        set_model_state_dict(self.model, state["model"], options=self.options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=self.options)
        for name in STATEFUL:
            getattr(self, name).load_state_dict(state[name])

    def weights_state(self, dtype: str | None) -> dict[str, Any]:
        """Model weights only, cast to `dtype` (a config dtype name) when given."""
        return {"model": cast_floating(self.model_state(), torch_dtype(dtype) if dtype is not None else None)}

    def model_state(self, base: bool = False) -> dict[str, Any]:
        """The model's state dict of plain tensors (float8-gathered weights unwrapped, sharing
        their storage), to save from or to load into in place; `base`: without LoRA's adapters
        (what initial weights hold: the adapters start from their init)."""
        state = plain_tensors(get_model_state_dict(self.model))
        return {key: value for key, value in state.items() if not (base and is_adapter(key))}

    def set_model_state(self, state: dict[str, Any], base: bool = False) -> None:
        """Put a loaded `model_state(base)` back into the model."""
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not base))

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's global shape in initial weights (the model's without adapters), by our names."""
        return {k: tuple(v.shape) for k, v in self.model_state(base=True).items() if torch.is_tensor(v)}

    def mesh(self) -> dict[str, int]:
        """The dims of the meshes the parameters live on ({} when not distributed), recorded for
        the log: the first parameter's, then those only others use (the experts' ep and efsdp)."""
        dims: dict[str, int] = {}
        for mesh in (param.device_mesh for param in self.model.parameters() if isinstance(param, DTensor)):
            for name, size in zip(mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim)), mesh.shape):
                dims.setdefault(name, size)
        return dims
