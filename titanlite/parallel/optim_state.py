"""Optimizer state dicts of a sharded model in FSDP1's three shapes, for the FSDP1 wrapper's
optimizer-state methods (`compat/fsdp1.py`):

- by name, whole: what `full_optim_state_dict` / `optim_state_dict` return and a checkpoint
  keeps (`{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}`), from DCP's
  `get_optimizer_state_dict` (gathered; on rank 0 only with `rank0_only`);
- by name, sharded: the same with DTensor shards, from `get_optimizer_state_dict` too;
- by id, loadable: what `torch.optim.Optimizer.load_state_dict` takes on this rank. Every
  state tensor shaped like its parameter becomes a DTensor laid out as the parameter is
  (`distribute_tensor`: sliced locally, or scattered from rank 0), so a whole state saved at
  one layout, or by a plain unwrapped optimizer, loads at any other.

Names are DCP's: the module's own, without wrapper prefixes (FSDP1's, activation
checkpointing's, torch.compile's), so a plain model and its wrapped copy agree. Ids number
the parameters in the optimizer's order, as `Optimizer.state_dict()` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.errors import TitanliteError
from titanlite.parallel.state_dict import checkpoint_module

_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for prefix in _PREFIXES:
        name = name.replace(prefix, "")
    return name


def parameter_order(model: nn.Module, optim: torch.optim.Optimizer | None = None, optim_input: Any = None) -> list[str]:
    """The names of the parameters in id order: the optimizer's param groups, else FSDP1's
    `optim_input` (parameters, or param-group dicts), else `model.parameters()`."""
    if optim is not None:
        params = [p for group in optim.param_groups for p in group["params"]]
    elif optim_input is not None:
        items = list(optim_input)
        params = [p for g in items for p in g["params"]] if items and isinstance(items[0], dict) else items
    else:
        params = list(checkpoint_module(model).parameters())
    names = {id(p): clean_name(name) for name, p in checkpoint_module(model).named_parameters()}  # tied ones once
    if missing := [i for i, p in enumerate(params) if id(p) not in names]:
        raise TitanliteError(f"optimizer state: parameter {missing[0]} of the optimizer is not one of the model's")
    return [names[id(p)] for p in params]


def whole_by_name(model: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool) -> dict[str, Any]:
    """Whole state tensors by name (on rank 0 in host memory with `rank0_only`, {} elsewhere).
    Every rank must call it (it all-gathers)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_optimizer_state_dict(checkpoint_module(model), optim, options=options)
    return {} if rank0_only and dist.is_initialized() and dist.get_rank() != 0 else state


def sharded_by_name(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards (DTensors) by name."""
    return get_optimizer_state_dict(checkpoint_module(model), optim)


def rekey(state: dict[str, Any], order: list[str], by: str) -> dict[str, Any]:
    """`state` keyed by parameter name ("name") or id ("id"), whichever key it has now."""
    to_id = {name: index for index, name in enumerate(order)}
    if by == "id":
        mapping = lambda key: key if isinstance(key, int) else _known(to_id, key)  # noqa: E731
    elif by == "name":
        mapping = lambda key: order[key] if isinstance(key, int) else key  # noqa: E731
    else:
        raise TitanliteError(f"optim_state_key_type: expected OptimStateKeyType.PARAM_NAME or PARAM_ID, got {by!r}")
    groups = [{**group, "params": [mapping(key) for key in group["params"]]} for group in state["param_groups"]]
    return {"state": {mapping(key): value for key, value in state["state"].items()}, "param_groups": groups}


def _known(to_id: dict[str, int], name: str) -> int:
    if name not in to_id:
        raise TitanliteError(f"optimizer state: {name!r} is not a parameter of the model")
    return to_id[name]


def loadable(
    state: dict[str, Any] | None,
    model: nn.Module,
    order: list[str],
    from_rank0: bool,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """A by-name state (whole or sharded) as `optimizer.load_state_dict` takes it on this rank.
    With `from_rank0` only rank 0's `state` is read (others may pass None): its layout is
    broadcast, each tensor scattered to the parameters' shards."""
    params = {clean_name(name): p for name, p in checkpoint_module(model).named_parameters()}
    if from_rank0 and dist.is_initialized() and dist.get_world_size(group) > 1:
        state = _broadcast_layout(state, order, params, group)
    state = rekey(state, order, "id")
    per_param = {}
    for index, values in state["state"].items():
        param = params[order[index]]
        per_param[index] = {key: _laid_out_like(value, param, from_rank0) for key, value in values.items()}
    return {"state": per_param, "param_groups": state["param_groups"]}


def _laid_out_like(value: Any, param: torch.Tensor, from_rank0: bool) -> Any:
    """A whole state tensor shaped like `param` as `param`'s DTensor layout; another plain
    tensor (AdamW's step) as a copy, since `Optimizer.load_state_dict` keeps the very tensor
    it is given and steps it in place: two optimizers loaded from one dict would share it."""
    if isinstance(value, _Placeholder):
        value = torch.empty(value.shape, dtype=value.dtype)
    if not _scattered(value, param):
        return value.clone() if torch.is_tensor(value) and not isinstance(value, DTensor) else value
    source = 0 if from_rank0 else None
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=source)


class _Placeholder:
    """A tensor's shape and dtype, broadcast in place of its data (which is scattered)."""

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


def _broadcast_layout(
    state: dict[str, Any] | None, order: list[str], params: dict[str, torch.Tensor], group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """Rank 0's by-name state on every rank: tensors shaped like their sharded parameter as
    placeholders (the scatter fills them), everything else (steps, hyperparameters, state of
    unsharded parameters) as it is; rank 0 keeps its own tensors."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        if state is None:
            raise TitanliteError("scatter_full_optim_state_dict: rank 0 has no optimizer state dict to scatter")
        state = rekey(state, order, "name")
        layout = {
            name: {k: _Placeholder(v) if _scattered(v, params[name]) else v for k, v in values.items()}
            for name, values in state["state"].items()
        }
        box[0] = {"state": layout, "param_groups": state["param_groups"]}
    dist.broadcast_object_list(box, src=0, group=group)
    return state if dist.get_rank() == 0 else box[0]


def _scattered(value: Any, param: torch.Tensor) -> bool:
    """Whether `value` is a whole state tensor laid out as its sharded parameter: a plain
    tensor of the shape of a DTensor `param`."""
    plain = torch.is_tensor(value) and not isinstance(value, DTensor)
    return plain and isinstance(param, DTensor) and value.shape == param.shape


# --- Parameter groups in a checkpoint (step/optim.py names each group under this key) --------

GROUP_KEY = "group"
_GROUPS = "param_groups."


def group_entries(flat_state: dict[str, Any]) -> dict[str, Any]:
    """`param_groups.<name>.group` -> the rule a parameter trains under, from an optimizer
    state dict flattened as checkpoints keep it (DCP's flatten_optimizer_state_dict)."""
    return {k: v for k, v in flat_state.items() if k.startswith(_GROUPS) and k.endswith(f".{GROUP_KEY}")}


def unsaved_group_setting(path: Any, flat_state: dict[str, Any], saved_keys: Any, prefix: str) -> str | None:
    """The line refusing a checkpoint that lacks a group setting this run's optimizer has (saved
    by another optimizer, or before parameter groups), or None. `saved_keys`: the checkpoint's
    keys, whose optimizer entries start with `prefix`."""
    missing = sorted(k for k in flat_state if k.startswith(_GROUPS) and f"{prefix}{k}" not in saved_keys)
    if not missing:
        return None
    return (
        f"{path}: the checkpoint has no {prefix}{missing[0]}: it was saved by another optimizer (optimizer.name) "
        "or without parameter groups; resume with the optimizer it was saved with"
    )


def regrouped(path: Any, live: dict[str, Any], loaded: dict[str, Any]) -> str | None:
    """The line refusing a resume that puts a parameter under another group rule than the
    saved run did (its lr scale, weight decay or algorithm would change silently), or None."""
    for key in sorted(live):
        if loaded.get(key) != live[key]:
            name = key[len(_GROUPS) : -len(GROUP_KEY) - 1]
            return (
                f"{path}: parameter {name} was saved in optimizer group {loaded.get(key)!r}, this run puts it in "
                f"{live[key]!r}: optimizer.param_groups and optimizer.weight_decay must be the saved run's"
            )
    return None
