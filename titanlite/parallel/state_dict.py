"""Full and sharded model state dicts of a parallelized model, through DCP's state-dict APIs
(never FSDP internals), with the defaults a training script wants.

- Sharded: each rank's DTensor shards, for `torch.distributed.checkpoint` (or `Checkpointer`):
  nothing is gathered, and a load at another layout reshards by name.
- Local: each rank's own pieces as plain tensors, saved and loaded per rank at one layout
  (hfai's default, FSDP1's LOCAL_STATE_DICT).
- Full: plain tensors under the unwrapped model's names, loadable into the model without any
  parallelism. Saving gathers them onto rank 0's host memory only (other ranks get {}), so a
  model that fits one host, not one GPU, can be written by one process; loading reads them
  on rank 0 alone and broadcasts, each rank keeping its shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titanlite.errors import TitanliteError
from titanlite.parallel.placement import local_tensor


def checkpoint_module(model: nn.Module) -> nn.Module:
    """The module whose state a checkpoint holds: `model`, or the module inside titanlite's
    wrappers (`parallel/wrapper.py`, marked `wraps_for_checkpoints`). The wrapper's own
    `state_dict()` is FSDP1's, full by default, and DCP's state-dict APIs call it: handed
    the wrapper they would gather every tensor instead of saving shards."""
    return model.module if getattr(model, "wraps_for_checkpoints", False) else model


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
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    options = StateDictOptions(full_state_dict=True, strict=strict, broadcast_from_rank0=from_rank0 and distributed)
    return set_model_state_dict(checkpoint_module(model), dict(state), options=options)


def local_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's own piece of every tensor as a plain tensor (its shard of a sharded
    parameter, the whole of anything else), under the model's names: what hfai's wrapper and
    FSDP1's LOCAL_STATE_DICT save per rank (`torch.save(state, f"model{rank}.pt")`). It loads
    back only at the layout that wrote it (`load_local_state_dict`); nothing is communicated."""
    return {name: local_tensor(v).detach() for name, v in checkpoint_module(model).state_dict(keep_vars=True).items()}


def load_local_state_dict(model: nn.Module, state: dict[str, Any], strict: bool = True) -> tuple[list[str], list[str]]:
    """Copy a `local_state_dict` of the same layout back into this rank's pieces; returns the
    missing and unexpected keys. A piece of another shape is one line naming it."""
    return copy_into(
        local_state_dict(model), state, strict, "a local (per-rank) state dict loads only at the layout that saved it"
    )


@torch.no_grad()
def copy_into(
    targets: dict[str, torch.Tensor], state: dict[str, Any], strict: bool, shape_hint: str
) -> tuple[list[str], list[str]]:
    """Copy `state`'s tensors into the plain tensors `targets` holds under the same names;
    returns the missing and unexpected keys (with `strict`, either is one line)."""
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if strict and (missing or unexpected):
        raise TitanliteError(
            f"load_state_dict: the state dict misses {missing[:3]} and has unexpected {unexpected[:3]}"
        )
    for name in sorted(set(targets) & set(state)):
        if tuple(state[name].shape) != tuple(targets[name].shape):
            raise TitanliteError(
                f"load_state_dict: {name} is {tuple(state[name].shape)} in the state dict but "
                f"{tuple(targets[name].shape)} here; {shape_hint}"
            )
        targets[name].copy_(state[name])
    return missing, unexpected
