"""Full and sharded model state dicts of a parallelized model, through DCP's state-dict APIs
(never FSDP internals), with the defaults a training script wants.

- Sharded: each rank's DTensor shards, for `torch.distributed.checkpoint` (or `Checkpointer`):
  nothing is gathered, and a load at another layout reshards by name.
- Full: plain tensors under the unwrapped model's names, loadable into the model without any
  parallelism. Saving gathers them onto rank 0's host memory only (other ranks get {}), so a
  model that fits one host, not one GPU, can be written by one process; loading reads them
  on rank 0 alone and broadcasts, each rank keeping its shard.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict


def checkpoint_module(model: nn.Module) -> nn.Module:
    """The module whose state a checkpoint holds: `model`, or the module inside titanlite's
    `FullyShardedDataParallel` (marked `wraps_for_checkpoints`). The wrapper's own
    `state_dict()` is FSDP1's, full by default, and DCP's state-dict APIs call it: handed
    the wrapper they would gather every tensor instead of saving shards."""
    return model.module if getattr(model, "wraps_for_checkpoints", False) else model


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's shards (DTensors) under the model's own names (wrappers' prefixes removed)."""
    return get_model_state_dict(checkpoint_module(model))


def load_sharded_state_dict(model: nn.Module, state: dict[str, Any], strict: bool = True) -> Any:
    """Put a `sharded_state_dict` (as loaded by DCP, at any layout) back into the model;
    returns the missing and unexpected keys."""
    return set_model_state_dict(checkpoint_module(model), state, options=StateDictOptions(strict=strict))


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, Any]:
    """Whole tensors, gathered: on rank 0 in host memory and {} elsewhere (`rank0_only`), or
    on every rank on the parameters' device. Every rank must call it (it all-gathers)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    return get_model_state_dict(checkpoint_module(model), options=options)


def load_full_state_dict(model: nn.Module, state: dict[str, Any], strict: bool = True, from_rank0: bool = True) -> Any:
    """Load whole tensors into a (parallelized) model: with `from_rank0` only rank 0's `state`
    is read (others may pass {}) and broadcast; otherwise every rank passes the same dict.
    Returns the missing and unexpected keys. (A copy of the dict goes in: DCP's broadcast
    replaces its values with this rank's shards, and the caller's dict stays whole.)"""
    options = StateDictOptions(full_state_dict=True, strict=strict, broadcast_from_rank0=from_rank0 and _distributed())
    return set_model_state_dict(checkpoint_module(model), dict(state), options=options)
