"""`FullyShardedDataParallel` with FSDP1's signature, built on FSDP2 (`fully_shard`) and DCP's
state-dict APIs, so code written for FSDP1 (or hfai's and Megatron's wrappers of it) moves to
FSDP2 by changing its import line. Nothing of FSDP1 is reimplemented: the arguments become
an FSDP2 plan (`fsdp1_options.py`), `summon_full_params` gathers DTensors (`full_params.py`),
and state dicts come from `get/set_model_state_dict` (`state_dict.py`).

Differences that remain: parameters are FSDP2's DTensor shards, not flat parameters (FSDP1's
`use_orig_params=True` view, whatever `use_orig_params` says); nesting is expressed by
`auto_wrap_policy` (a module wrapped on its own and again inside a wrapped parent is not
supported); optimizer state dicts come from DCP's `get/set_optimizer_state_dict` or
`titanlite.Checkpointer` rather than `FSDP.optim_state_dict`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (BackwardPrefetch, FullStateDictConfig, ShardedStateDictConfig, StateDictConfig,
                                    StateDictType)

from titanlite.errors import TitanliteError
from titanlite.parallel import full_params, state_dict
from titanlite.parallel.fsdp import shard_model
from titanlite.parallel.fsdp1_options import Fsdp1Plan, plan_fsdp1
from titanlite.parallel.grad_norm import clip_gradients_
from titanlite.parallel.units import outermost

_WRAPPED = "_fsdp_wrapped_module"  # FSDP1's attribute name, stripped from parameter names as FSDP1 does
_CONFIGS = {StateDictType.FULL_STATE_DICT: FullStateDictConfig, StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig}


class FullyShardedDataParallel(nn.Module):
    """FSDP1's wrapper over FSDP2: the same arguments, plus `reshard_after_forward` (FSDP2's;
    an int reshards to groups of that many ranks) and `fsdp_group_size` (hfai's: shard within
    groups of that many ranks, replicate across). See `fsdp1_options.py` for each argument."""

    wraps_for_checkpoints = True  # titanlite's checkpoint APIs save `.module`'s shards (state_dict.checkpoint_module)

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: Any = None,
        cpu_offload: Any = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Any = None,
        ignored_modules: Any = None,
        param_init_fn: Any = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,  # FSDP2 bounds its all-gathers by design: accepted, no effect
        use_orig_params: bool = False,  # FSDP2 always keeps the original parameters: accepted, no effect
        ignored_states: Any = None,
        device_mesh: Any = None,
        *,
        reshard_after_forward: bool | int | None = None,
        fsdp_group_size: int | None = None,
    ):
        super().__init__()
        plan = plan_fsdp1(module, process_group=process_group, sharding_strategy=sharding_strategy, cpu_offload=cpu_offload,
                          auto_wrap_policy=auto_wrap_policy, backward_prefetch=backward_prefetch,
                          mixed_precision=mixed_precision, ignored_modules=ignored_modules, param_init_fn=param_init_fn,
                          device_id=device_id, forward_prefetch=forward_prefetch, ignored_states=ignored_states,
                          device_mesh=device_mesh, reshard_after_forward=reshard_after_forward, fsdp_group_size=fsdp_group_size)
        if any(p.device.type != "meta" for p in module.parameters()):
            module.to(plan.device)
        if sync_module_states:
            _broadcast_from_first_rank(module, plan.group)
        shard_model(module, plan.mesh, plan.units, mp_policy=plan.mp_policy, reshard_after_forward=plan.reshard_after_forward,
                    cpu_offload=plan.cpu_offload, ignored_params=plan.ignored_params)
        _set_prefetch(module, plan)
        setattr(self, _WRAPPED, module)
        self._plan = plan
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config: StateDictConfig = FullStateDictConfig()

    @property
    def module(self) -> nn.Module:
        """The wrapped module (FSDP1's `.module`)."""
        return getattr(self, _WRAPPED)

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module, as in FSDP1."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__(_WRAPPED), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's names, without the wrapper's prefix (FSDP1 with use_orig_params)."""
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace(_WRAPPED + ".", ""), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, b in super().named_buffers(*args, **kwargs):
            yield name.replace(_WRAPPED + ".", ""), b

    # --- FSDP1's static helpers -------------------------------------------------------------

    summon_full_params = staticmethod(full_params.summon_full_params)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                            state_dict_config: StateDictConfig | None = None, optim_state_dict_config: Any = None) -> None:
        """What `state_dict()` / `load_state_dict()` of every wrapper in `module` mean from now on."""
        if state_dict_type not in _CONFIGS:
            raise TitanliteError(f"state_dict_type: {state_dict_type} has no FSDP2 meaning (no flat parameters); "
                                 "use FULL_STATE_DICT or SHARDED_STATE_DICT")
        for wrapper in _wrappers(module):
            wrapper._state_dict_type = state_dict_type
            wrapper._state_dict_config = state_dict_config or _CONFIGS[state_dict_type]()

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config: StateDictConfig | None = None,
                        optim_state_dict_config: Any = None) -> Iterator[None]:
        """`set_state_dict_type` for the duration of the block."""
        before = [(w, w._state_dict_type, w._state_dict_config) for w in _wrappers(module)]
        FullyShardedDataParallel.set_state_dict_type(module, state_dict_type, state_dict_config)
        try:
            yield
        finally:
            for wrapper, kind, config in before:
                wrapper._state_dict_type, wrapper._state_dict_config = kind, config

    # --- state dicts, gradient sync, clipping -----------------------------------------------

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """Full (whole tensors; FullStateDictConfig's rank0_only and offload_to_cpu as in FSDP1)
        or sharded (DTensors for torch.distributed.checkpoint), under the module's own names.
        Every rank must call it."""
        config = self._state_dict_config
        if self._state_dict_type == StateDictType.SHARDED_STATE_DICT:
            result = state_dict.sharded_state_dict(self.module)
        else:
            result = state_dict.full_state_dict(self.module, rank0_only=config.rank0_only)
            if config.offload_to_cpu:
                result = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in result.items()}
        destination = {} if destination is None else destination
        destination.update({prefix + k: v for k, v in result.items()})
        return destination

    def load_state_dict(self, state: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """The counterpart of `state_dict()` under the current state-dict type (a full one:
        every rank passes the same whole tensors; each keeps its shard)."""
        if assign:
            raise TitanliteError("load_state_dict: assign=True has no FSDP2 meaning (the shards are FSDP's); leave it False")
        if self._state_dict_type == StateDictType.SHARDED_STATE_DICT:
            return state_dict.load_sharded_state_dict(self.module, state, strict=strict)
        return state_dict.load_full_state_dict(self.module, state, strict=strict, from_rank0=False)

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
        """Clip the total L2 gradient norm over every shard and replica (one all-reduce); returns it."""
        if float(norm_type) != 2.0:
            raise TitanliteError(f"clip_grad_norm_: norm_type {norm_type} is not supported (only the L2 norm, 2.0)")
        return clip_gradients_(list(self.parameters()), float(max_norm), world=True, group=self._plan.group)


def _wrappers(module: nn.Module) -> list[FullyShardedDataParallel]:
    return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]


def _set_prefetch(module: nn.Module, plan: Fsdp1Plan) -> None:
    """FSDP1's forward_prefetch (the next unit, explicitly) and backward_prefetch None (none)."""
    units = outermost(plan.units, module)
    for index, unit in enumerate(units):
        if plan.forward_prefetch:
            unit.set_modules_to_forward_prefetch(units[index + 1 : index + 2])
        if not plan.backward_prefetch:
            unit.set_modules_to_backward_prefetch([])


@torch.no_grad()
def _broadcast_from_first_rank(module: nn.Module, group: dist.ProcessGroup) -> None:
    """`sync_module_states`: every parameter and buffer as the group's first rank has it."""
    if dist.get_world_size(group) == 1:
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, group=group, group_src=0)
