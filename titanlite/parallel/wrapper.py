"""The one core under the wrapper APIs users port from (`titanlite.compat.fsdp1`, `.hfai`,
`.megatron`): a module holding the user's module, sharded by FSDP2 (`fully_shard` per unit,
then the root) as a `WrapPlan` says. Each compat class is a thin signature over it: it
checks its own arguments (`wrap_plan.py`) and gives its document's meaning to `state_dict`
and friends, with the state-dict functions of `state_dict.py` (DCP's APIs underneath).

What the core does the same for all three: the module moves to the plan's device, optional
`sync_module_states` (rank 0's values broadcast before sharding), sharding, prefetch
(FSDP2's implicit one, none, or explicit), and the methods every document shares:
`module`, attribute fall-through, FSDP1's parameter names, `no_sync`, `clip_grad_norm_`,
`apply` under whole parameters, and the units FSDP2 made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from titanlite.errors import TitanliteError
from titanlite.parallel.full_params import summon_full_params
from titanlite.parallel.fsdp import FsdpOptions, shard_model
from titanlite.parallel.grad_norm import scale_to_norm_, total_grad_norm
from titanlite.parallel.wrap_plan import WrapPlan

WRAPPED = "_fsdp_wrapped_module"  # FSDP1's attribute name, stripped from parameter names as FSDP1 does


class ShardedWrapper(nn.Module):
    """`module` sharded by FSDP2 as `plan` says; see the module docstring."""

    wraps_for_checkpoints = True  # titanlite's checkpoint APIs save `.module`'s shards (state_dict.checkpoint_module)

    def __init__(self, module: nn.Module, plan: WrapPlan, sync_module_states: bool = False):
        super().__init__()
        reshard, shards = plan.reshard_after_forward, plan.mesh.size(plan.mesh.ndim - 1)
        if not isinstance(reshard, bool) and shards % reshard:
            raise TitanliteError(
                f"reshard_after_forward: {reshard} ranks do not divide the {shards} ranks "
                "each parameter is sharded over"
            )
        if any(p.device.type != "meta" for p in module.parameters()):
            module.to(plan.device)
        if sync_module_states:
            broadcast_from_first_rank(module, plan.group)
        shard_in_full_precision(plan)
        units = [unit for unit in plan.units if unit not in plan.full_precision_units]
        options = FsdpOptions(plan.mp_policy, reshard, plan.cpu_offload, ignored_params=plan.ignored_params)
        shard_model(module, plan.mesh, units, options)
        set_prefetch(module, plan)
        setattr(self, WRAPPED, module)
        self._plan = plan

    @property
    def module(self) -> nn.Module:
        """The wrapped module (FSDP1's `.module`)."""
        return getattr(self, WRAPPED)

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module, as in FSDP1."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__(WRAPPED), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's names, without the wrapper's prefix (FSDP1 with use_orig_params)."""
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace(WRAPPED + ".", ""), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, b in super().named_buffers(*args, **kwargs):
            yield name.replace(WRAPPED + ".", ""), b

    def apply(self, fn: Callable[[nn.Module], None]) -> ShardedWrapper:
        """`fn` on every submodule (and the wrapper) with whole parameters, written back to
        the shards afterwards (FSDP1's `apply`: an init function sees whole weights)."""
        with summon_full_params(self, writeback=True):
            super().apply(fn)
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unreduced) in the block; the next backward outside it
        reduces the sum."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the total L2 gradient norm, FSDP1's: the sharded gradients' over every shard
        and replica (one all-reduce), plus this rank's own unsharded ones (ignored modules,
        which FSDP does not reduce) counted once, not once per rank; returns it."""
        if float(norm_type) != 2.0:
            raise TitanliteError(f"clip_grad_norm_: norm_type {norm_type} is not supported (only the L2 norm, 2.0)")
        with_grad = [p for p in self.parameters() if p.grad is not None]
        sharded = [p for p in with_grad if isinstance(p, DTensor)]
        local = [p for p in with_grad if not isinstance(p, DTensor)]
        norm = total_grad_norm(sharded, world=True, group=self._plan.group).square()
        norm = (norm + total_grad_norm(local, world=False).to(norm.device).square()).sqrt()
        scale_to_norm_(with_grad, norm, max_norm)
        return norm

    def sharded_units(self) -> list[FSDPModule]:
        """The modules FSDP2 sharded on their own inside the root (what FSDP1 would have
        wrapped in nested wrappers), in the model's order."""
        return [m for m in self.module.modules() if m is not self.module and isinstance(m, FSDPModule)]


def shard_in_full_precision(plan: WrapPlan) -> None:
    """`fully_shard` the plan's full-precision units (leaves, so before any other unit) with
    no mixed precision, as FSDP1 wraps them: inputs cast to float32 before their forward and
    outputs back to the inputs' dtype after it (FSDP1's own hooks), so the units around them
    keep computing in the low precision."""
    if not plan.full_precision_units:
        return
    from torch.distributed.fsdp._common_utils import _override_module_mixed_precision

    config = FsdpOptions(cpu_offload=plan.cpu_offload).config(plan.mesh)  # no mixed precision, no ignored params
    for unit in plan.full_precision_units:
        fully_shard(unit, reshard_after_forward=plan.reshard_after_forward, **config)
        _override_module_mixed_precision(unit, {type(unit)})


def set_prefetch(module: nn.Module, plan: WrapPlan) -> None:
    """Over every unit, nested ones included, in the model's order. Forward: the next unit
    explicitly (FSDP1's forward_prefetch), else FSDP2's implicit order. Backward: FSDP2's
    implicit one-ahead ("default"); none ("off": each unit, and the root, prefetches only
    itself, which it already holds, since FSDP2 reads an empty list as "default"); or the
    unit before it in the model ("previous", Megatron's)."""
    units = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
    for index, unit in enumerate(units):
        if plan.forward_prefetch:
            unit.set_modules_to_forward_prefetch(units[index + 1 : index + 2])
        if plan.backward_prefetch == "previous":
            unit.set_modules_to_backward_prefetch(units[index - 1 : index] if index else [])
    for unit in [*units, module] if plan.backward_prefetch == "off" else []:
        unit.set_modules_to_backward_prefetch([unit])


@torch.no_grad()
def broadcast_from_first_rank(module: nn.Module, group: dist.ProcessGroup) -> None:
    """`sync_module_states`: every parameter and buffer as the group's first rank has it."""
    if dist.get_world_size(group) == 1:
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, group=group, group_src=0)


def wrappers_in(module: nn.Module, kind: type = ShardedWrapper) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, kind)]
