"""FSDP2: `fully_shard` each block, then the root, on the data-parallel mesh."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from titanlite.config.dtypes import DTYPES
from titanlite.errors import TitanliteError


def shard_units(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The modules to shard one by one, in the order `fully_shard` must take them: the
    model's blocks, or every module of the named classes, innermost first. (A parent sharded
    before its child leaves the child's parameters in the parent's group: "Cannot
    concatenate overlapping meshes".)"""
    if not class_names:
        return list(model.layers.values())
    named = [(name, m) for name, m in model.named_modules() if type(m).__name__ in class_names and m is not model]
    found = {type(m).__name__ for _, m in named}
    missing = [name for name in class_names if name not in found]
    if missing:
        raise TitanliteError(f"parallelism.fsdp_shard_modules: no module of class {', '.join(missing)} in the model")
    return [m for _, m in sorted(named, key=lambda item: -item[0].count("."))]  # deepest first, stable within a depth


def outermost(units: list[nn.Module], model: nn.Module) -> list[nn.Module]:
    """The units no other unit contains, in the model's order (what explicit prefetch walks)."""
    inner = {id(child) for unit in units for child in unit.modules() if child is not unit}
    wanted = {id(unit) for unit in units if id(unit) not in inner}
    return [m for m in model.modules() if id(m) in wanted]


def reshard_policy(setting: str, last: bool, pipelined: bool) -> bool | int:
    """`fsdp_reshard_after_forward` for one unit: True, False, or an int (reshard to groups
    of that many ranks, FSDP2's middle ground for nodes)."""
    if setting.isdigit():
        return int(setting)
    return {"always": True, "never": False, "default": not (last or pipelined)}[setting]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    cpu_offload: bool,
    prefetch_depth: int,
    shard_module_classes: list[str],
    pipelined: bool = False,
) -> None:
    """Shard parameters over `dp_mesh` (2D replicate x shard means HSDP).

    reshard_after_forward: "always" frees every unit's gathered weights after forward (least
    memory), "never" keeps them to backward (no re-gather), a number k keeps them gathered
    over groups of k ranks (a node's, say: backward re-gathers within it), "default" reshards all but the
    last unit, whose weights backward needs first anyway; in a pipeline stage (`pipelined`)
    "default" keeps them all, as torchtitan does: the schedule runs several microbatches'
    forwards before their backwards, and resharding would all-gather again for each.
    """
    config = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype]),
    }
    if cpu_offload:
        # Pinned host memory speeds host<->GPU copies; there is nothing to pin for without one.
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    units = shard_units(model, shard_module_classes)
    for index, unit in enumerate(units):
        fully_shard(unit, reshard_after_forward=reshard_policy(reshard_after_forward, index == len(units) - 1, pipelined), **config)
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **config)
    if prefetch_depth > 0:
        set_explicit_prefetch(outermost(units, model), prefetch_depth)


def set_explicit_prefetch(units: list[nn.Module], depth: int) -> None:
    """All-gather the next `depth` units' weights while the current one computes, in both
    directions, instead of relying on FSDP2's implicit one-ahead prefetch."""
    for index, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[index + 1 : index + 1 + depth])
        unit.set_modules_to_backward_prefetch(units[max(0, index - depth) : index][::-1])


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip (False) or do (True) the reduce-scatter / all-reduce at the end of backward.

    Gradient accumulation turns it off for every microbatch but the last, so gradients
    accumulate unsharded locally and are reduced once per step.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
