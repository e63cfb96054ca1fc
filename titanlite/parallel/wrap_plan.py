"""A wrapper API's constructor arguments turned into an FSDP2 plan (`WrapPlan`): which mesh,
which units, which reshard, precision, offload and prefetch. The compat wrappers
(`titanlite.compat.fsdp1`, `.hfai`, `.megatron`) check their own signatures with these
functions and hand the plan to the one core, `parallel/wrapper.py`. Each argument keeps
its meaning where FSDP2 has one; one that would change what training computes and has
none is refused in one line naming it.

Sharding strategies (FSDP1's), in FSDP2's terms:
- FULL_SHARD: shard over all ranks, reshard after forward (ZeRO-3);
- SHARD_GRAD_OP: shard, keep the gathered weights from forward to backward (ZeRO-2-like);
- HYBRID_SHARD / _HYBRID_SHARD_ZERO2: a 2D (replicate, shard) mesh: shard within groups of
  `fsdp_group_size` ranks (hfai's option; default a node, LOCAL_WORLD_SIZE), replicate across;
- NO_SHARD: a (world, 1) mesh: every rank keeps whole weights, gradients all-reduced (DDP).
`fsdp_group_size` alone (hfai's way) means hybrid sharding with groups of that size.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp.wrap import _Policy

from titanlite.errors import TitanliteError
from titanlite.parallel.units import innermost_first, select

RESHARDS_AFTER_FORWARD = {
    ShardingStrategy.FULL_SHARD: True,
    ShardingStrategy.SHARD_GRAD_OP: False,
    ShardingStrategy.HYBRID_SHARD: True,
    ShardingStrategy._HYBRID_SHARD_ZERO2: False,
    ShardingStrategy.NO_SHARD: False,
}
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
# The keyword an auto-wrap policy takes for the parameters its units have not taken:
# v1.12 and fairscale/hfai spelled it `unwrapped_params`, torch >= 1.13 `nonwrapped_numel`.
_NUMEL_KEYWORDS = ("nonwrapped_numel", "unwrapped_params")

# How backward all-gathers are prefetched: FSDP2's implicit one-ahead ("default"), none
# ("off"), or each unit the one before it in the model explicitly ("previous", Megatron's
# choice under activation recompute, which reorders FSDP2's implicit one).
BackwardPrefetchMode = Literal["default", "off", "previous"]


@dataclass
class WrapPlan:
    """What a wrapper does with a module, in FSDP2's terms."""

    mesh: DeviceMesh
    group: dist.ProcessGroup  # every rank of the mesh: the gradient norm's all-reduce
    units: list[nn.Module]  # innermost first; the root comes after them
    reshard_after_forward: bool | int
    backward_prefetch: BackwardPrefetchMode
    device: torch.device
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    cpu_offload: bool = False
    forward_prefetch: bool = False
    ignored_params: set[nn.Parameter] = field(default_factory=set)
    # Units sharded without mixed precision, their inputs cast up and outputs back (FSDP1's
    # `MixedPrecision._module_classes_to_ignore`, BatchNorm by default); also in `units`.
    full_precision_units: list[nn.Module] = field(default_factory=list)


def require_process_group(wrapper: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise TitanliteError(
            f"{wrapper}: no process group; call titanlite.init_distributed() "
            "(or torch.distributed.init_process_group) first"
        )


def strategy_of(value: Any) -> ShardingStrategy:
    """A `ShardingStrategy`, or its name; None is FSDP1's default, FULL_SHARD."""
    if value is None:
        return ShardingStrategy.FULL_SHARD
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, str) and value.upper() in ShardingStrategy.__members__:
        return ShardingStrategy[value.upper()]
    names = ", ".join(n for n in ShardingStrategy.__members__ if not n.startswith("_"))
    raise TitanliteError(f"sharding_strategy: {value!r} is not one of {names}")


def device_of(device_id: int | torch.device | None) -> torch.device:
    """FSDP1's `device_id`: the device parameters live and compute on."""
    if device_id is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TitanliteError(f"device_id: {device_id!r} is a CUDA device, but this machine has none")
    return device


def build_fsdp_mesh(
    process_group: Any,
    device_mesh: DeviceMesh | None,
    strategy: ShardingStrategy,
    fsdp_group_size: int | None,
    device_type: str,
) -> tuple[DeviceMesh, dist.ProcessGroup]:
    """The mesh `fully_shard` gets, and the group spanning it."""
    if device_mesh is not None:
        if process_group is not None:
            raise TitanliteError("process_group: pass it or device_mesh, not both")
        return device_mesh, device_mesh.get_group() if device_mesh.ndim == 1 else dist.group.WORLD
    if isinstance(process_group, tuple):
        raise TitanliteError(
            "process_group: an (intra-node, inter-node) pair is not taken; pass fsdp_group_size= "
            "(ranks per shard group) or a 2D device_mesh for hybrid sharding"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    shard = _shard_group_size(strategy, fsdp_group_size, world)
    if shard == world:
        return DeviceMesh.from_group(group, device_type), group
    if group is not dist.group.WORLD and world != dist.get_world_size():
        raise TitanliteError(
            "process_group: hybrid sharding (replicate x shard) runs over all ranks; drop process_group"
        )
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard")), group


def _shard_group_size(strategy: ShardingStrategy, fsdp_group_size: int | None, world: int) -> int:
    """How many ranks share one copy of the weights."""
    if strategy == ShardingStrategy.NO_SHARD:
        if fsdp_group_size is not None:
            raise TitanliteError("fsdp_group_size: NO_SHARD shards nothing; drop one of them")
        return 1
    if fsdp_group_size is not None:
        if type(fsdp_group_size) is not int or fsdp_group_size < 1 or world % fsdp_group_size:  # not a bool
            raise TitanliteError(
                f"fsdp_group_size: {fsdp_group_size!r} must be a whole number dividing the {world} ranks"
            )
        return fsdp_group_size
    if strategy in _HYBRID:
        shard = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % shard:
            raise TitanliteError(
                f"sharding_strategy: {strategy.name} shards within a node of {shard} ranks, which does "
                f"not divide the {world} ranks; pass fsdp_group_size="
            )
        return shard
    return world


def precision_of(mixed_precision: MixedPrecision | None) -> MixedPrecisionPolicy:
    """FSDP1's `MixedPrecision` as FSDP2's policy; the parts FSDP2 has no meaning for refused."""
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if not isinstance(mixed_precision, MixedPrecision):
        raise TitanliteError(
            f"mixed_precision: expected torch.distributed.fsdp.MixedPrecision, got {type(mixed_precision).__name__}"
        )
    if mixed_precision.buffer_dtype is not None:
        raise TitanliteError(
            "mixed_precision: buffer_dtype has no FSDP2 meaning (buffers stay as they are); "
            "cast the buffers yourself, e.g. module.to(dtype) for them, and leave it None"
        )
    if mixed_precision.keep_low_precision_grads:
        raise TitanliteError(
            "mixed_precision: keep_low_precision_grads has no FSDP2 meaning (gradients reach "
            "the optimizer in the parameters' dtype); leave it False"
        )
    cast = mixed_precision.cast_forward_inputs or mixed_precision.cast_root_forward_inputs
    param_dtype, reduce_dtype = mixed_precision.param_dtype, mixed_precision.reduce_dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast)


def wrap_units(module: nn.Module, policy: Any, ignored: set[nn.Module]) -> list[nn.Module]:
    """The modules FSDP1's `auto_wrap_policy` would have wrapped (never the root), innermost
    first: a `ModuleWrapPolicy`/`CustomPolicy`, a callable of FSDP1's `(module, recurse,
    nonwrapped_numel)` contract or v1.12's and hfai's `(module, recurse, unwrapped_params)`
    (`transformer_auto_wrap_policy` or `size_based_auto_wrap_policy` partials, a custom
    policy), a predicate `fn(module)`, or a set of module classes (Megatron)."""
    if policy is None:
        return []
    if isinstance(policy, _Policy):
        picked = [m for m in policy._run_policy(module, ignored, {}) if m is not module]  # FSDP1's own traversal
        order = {id(m): name for name, m in module.named_modules()}
        return innermost_first([(order[id(m)], m) for m in picked])
    if callable(policy) and not isinstance(policy, type) and "recurse" in _parameters(policy):
        keyword = next((k for k in _NUMEL_KEYWORDS if k in _parameters(policy)), _NUMEL_KEYWORDS[0])
        return _recursive_units(
            module, lambda m, recurse, numel: policy(module=m, recurse=recurse, **{keyword: numel}), ignored, root=True
        )
    if isinstance(policy, (set, frozenset, list, tuple)) or (callable(policy) and not isinstance(policy, type)):
        inside = {id(m) for i in ignored for m in i.modules()}
        return innermost_first([(n, m) for n, m in select(module, policy, "auto_wrap_policy") if id(m) not in inside])
    raise TitanliteError(
        f"auto_wrap_policy: expected an FSDP1 wrap policy, a callable or a set of module classes, got {policy!r}"
    )


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _recursive_units(module: nn.Module, ask: Any, ignored: set[nn.Module], root: bool = False) -> list[nn.Module]:
    """FSDP1's `_recursive_wrap`, collecting instead of wrapping: ask the policy whether to
    descend (recurse=True), collect the children's units, then ask whether to wrap this module
    with the parameters its units did not take (recurse=False). Children come out first."""
    numel = sum(p.numel() for p in module.parameters())
    if not ask(module, True, numel):
        return []
    units = [
        unit for child in module.children() if child not in ignored for unit in _recursive_units(child, ask, ignored)
    ]
    wrapped = sum(p.numel() for unit in units for p in unit.parameters())
    if not root and ask(module, False, numel - wrapped):
        units.append(module)
    return units


def ignored_of(ignored_modules: Any, ignored_states: Any) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """FSDP1's `ignored_modules` / `ignored_states` as modules to skip and FSDP2's ignored params."""
    if ignored_modules is not None and ignored_states is not None:
        raise TitanliteError("ignored_states: pass it or ignored_modules, not both")
    items = list(ignored_modules or ignored_states or [])
    modules = {m for m in items if isinstance(m, nn.Module)}
    params = {p for m in modules for p in m.parameters()} | {p for p in items if isinstance(p, nn.Parameter)}
    return modules, params


def backward_prefetch_of(value: Any) -> BackwardPrefetchMode:
    """BACKWARD_PRE and BACKWARD_POST both mean FSDP2's one-ahead backward prefetch (they
    differ only in when FSDP1 issued it); None turns it off."""
    if value is None:
        return "off"
    if not isinstance(value, BackwardPrefetch):
        raise TitanliteError(
            f"backward_prefetch: expected BackwardPrefetch.BACKWARD_PRE, BACKWARD_POST or None, got {value!r}"
        )
    return "default"


def forward_prefetch_of(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TitanliteError(f"forward_prefetch: expected True or False, got {value!r}")
    return value


def offload_of(cpu_offload: CPUOffload | None) -> bool:
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TitanliteError(
            f"cpu_offload: expected torch.distributed.fsdp.CPUOffload, got {type(cpu_offload).__name__}"
        )
    return bool(cpu_offload and cpu_offload.offload_params)


def reshard_of(value: Any, strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD) -> bool | int:
    """`reshard_after_forward` (FSDP2's, hfai's and Megatron's) or, when None, the strategy's."""
    if value is None:
        return RESHARDS_AFTER_FORWARD[strategy]
    if isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return value
    raise TitanliteError(f"reshard_after_forward: expected True, False or a number of ranks, got {value!r}")
