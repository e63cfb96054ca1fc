"""PyTorch FSDP1's `FullyShardedDataParallel` (the v1.12 API page, plus what later pages
added) on FSDP2: code written for it changes only its import line,

    from titanlite.compat.fsdp1 import FullyShardedDataParallel as FSDP, ShardingStrategy, MixedPrecision

and keeps its arguments, static helpers and state-dict types. The names FSDP1 code imports
beside the class are re-exported here. Nothing of FSDP1 is reimplemented: the arguments
become an FSDP2 plan (`parallel/wrap_plan.py`), the core (`parallel/wrapper.py`) shards with
`fully_shard`, state dicts come from DCP's `get/set_model_state_dict` and
`get_optimizer_state_dict` (`parallel/state_dict.py`, `parallel/optim_state.py`).

Differences that remain (docs/library.md has the table): parameters are FSDP2's DTensor
shards, not flat parameters (FSDP1's `use_orig_params=True` view, whatever it says);
nesting is said with `auto_wrap_policy`, not by wrapping a wrapped module again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from titanlite.compat.placement import placement
from titanlite.errors import TitanliteError
from titanlite.parallel import full_params, optim_state, state_dict, wrap_plan
from titanlite.parallel.wrapper import ShardedWrapper, wrappers_in

__all__ = [
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "MixedPrecision",
    "CPUOffload",
    "BackwardPrefetch",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
    "ModuleWrapPolicy",
    "CustomPolicy",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]

_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}

_KEY_TYPES = {OptimStateKeyType.PARAM_NAME: "name", OptimStateKeyType.PARAM_ID: "id"}

_NO_PARAM_INIT_FN = (
    "param_init_fn: FSDP2 has no per-unit init hook; build the model on meta, wrap it, "
    "then call module.to_empty(device=...) and your init (it fills each rank's shard)"
)


class _OptimStateDicts:
    """FSDP1's optimizer state-dict static methods (parallel/optim_state.py underneath), a part
    of `FullyShardedDataParallel`: keyed by parameter name, whole or sharded as the model's
    state-dict type says."""

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: Any = None,
    ) -> dict[str, Any]:
        """The whole optimizer state keyed by parameter name (on rank 0 only with `rank0_only`)."""
        return optim_state.whole_by_name(model, optim, rank0_only)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """This rank's part of a whole state every rank holds, for `optim.load_state_dict`."""
        order = optim_state.parameter_order(model, optim, optim_input)
        return optim_state.loadable(full_optim_state_dict, model, order, from_rank0=False)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """Like `shard_full_optim_state_dict`, with the whole state on rank 0 alone (scattered)."""
        optim, group = _v1_12_group(optim, group)
        order = optim_state.parameter_order(model, optim, optim_input)
        return optim_state.loadable(full_optim_state_dict, model, order, from_rank0=True, group=group)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Keys by name (PARAM_NAME, a wrapped model's) or by id (PARAM_ID, a plain optimizer's)."""
        by = _KEY_TYPES.get(optim_state_key_type, optim_state_key_type)  # anything else: optim_state.rekey refuses it
        return optim_state.rekey(optim_state_dict, optim_state.parameter_order(model, optim, optim_input), by)

    @staticmethod
    def optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Any = None, group: Any = None
    ) -> dict[str, Any]:
        """By name, as the model's state-dict type says: whole (FullOptimStateDictConfig's
        rank0_only) or sharded."""
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        if settings.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            return optim_state.sharded_by_name(model, optim)
        _refuse_local(settings, "optim_state_dict")
        return optim_state.whole_by_name(model, optim, settings.optim_state_dict_config.rank0_only)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """An `optim_state_dict()` result as `optim.load_state_dict` takes it (loaded too with `load_directly`)."""
        if is_named_optimizer:
            raise TitanliteError(
                "optim_state_dict_to_load: is_named_optimizer=True (torchrec's KeyedOptimizer) is not supported"
            )
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        _refuse_local(settings, "optim_state_dict_to_load")
        full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
        from_rank0 = full and settings.optim_state_dict_config.rank0_only
        order = optim_state.parameter_order(model, optim)
        result = optim_state.loadable(optim_state_dict, model, order, from_rank0, group)
        if load_directly:
            optim.load_state_dict(result)
        return result


class FullyShardedDataParallel(_OptimStateDicts, ShardedWrapper):
    """FSDP1's wrapper over FSDP2: FSDP1's arguments, plus `reshard_after_forward` (FSDP2's;
    an int reshards to groups of that many ranks) and `fsdp_group_size` (hfai's: shard within
    groups of that many ranks, replicate across). `parallel/wrap_plan.py` says what each
    argument becomes."""

    # What `state_dict()` and friends mean (`set_state_dict_type`): full state dicts until set.
    _settings = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | str | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
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
        wrap_plan.require_process_group("FullyShardedDataParallel")
        if param_init_fn is not None:
            raise TitanliteError(_NO_PARAM_INIT_FN)
        strategy = wrap_plan.strategy_of(sharding_strategy)
        plan = wrap_plan.WrapPlan(  # the arguments checked in their order in the signature
            **placement(process_group, device_mesh, strategy, fsdp_group_size, device_id),
            **_units(module, auto_wrap_policy, mixed_precision, ignored_modules, ignored_states),
            reshard_after_forward=wrap_plan.reshard_of(reshard_after_forward, strategy),
            cpu_offload=wrap_plan.offload_of(cpu_offload),
            backward_prefetch=wrap_plan.backward_prefetch_of(backward_prefetch),
            forward_prefetch=wrap_plan.forward_prefetch_of(forward_prefetch),
        )
        super().__init__(module, plan, sync_module_states)

    # v1.12's property: the parameters that have a gradient.
    params_with_grad = property(lambda self: [p for p in self.parameters() if p.grad is not None])

    # --- module state dicts -------------------------------------------------------------------

    summon_full_params = staticmethod(full_params.summon_full_params)

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """What `state_dict()`, `load_state_dict()` and the optimizer-state methods of every
        wrapper in `module` mean from now on; returns the previous settings."""
        if state_dict_type not in _CONFIGS:
            raise TitanliteError(f"state_dict_type: expected a StateDictType, got {state_dict_type!r}")
        model_config, optim_config = _CONFIGS[state_dict_type]
        settings = StateDictSettings(
            state_dict_type, state_dict_config or model_config(), optim_state_dict_config or optim_config()
        )
        before = FullyShardedDataParallel.get_state_dict_type(module)
        for wrapper in wrappers_in(module, FullyShardedDataParallel):
            wrapper._settings = settings
        return before

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        found = wrappers_in(module, FullyShardedDataParallel)
        if not found:
            raise TitanliteError("get_state_dict_type: the module holds no FullyShardedDataParallel")
        return found[0]._settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """`set_state_dict_type` for the duration of the block."""
        before = [(w, w._settings) for w in wrappers_in(module, FullyShardedDataParallel)]
        FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            for wrapper, settings in before:
                wrapper._settings = settings

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """Full (whole tensors; FullStateDictConfig's rank0_only and offload_to_cpu as in
        FSDP1), sharded (DTensors for torch.distributed.checkpoint) or local (each rank's own
        pieces as plain tensors), under the module's own names. Every rank must call it."""
        kind, config = self._settings.state_dict_type, self._settings.state_dict_config
        if kind == StateDictType.SHARDED_STATE_DICT:
            result = state_dict.sharded_state_dict(self.module)
        elif kind == StateDictType.LOCAL_STATE_DICT:
            result = state_dict.local_state_dict(self.module)
        else:
            result = state_dict.full_state_dict(self.module, rank0_only=config.rank0_only)
            if config.offload_to_cpu:
                result = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in result.items()}
        destination = {} if destination is None else destination
        destination.update({prefix + k: v for k, v in result.items()})
        return destination

    def load_state_dict(self, state: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """The counterpart of `state_dict()` under the current type (a full one: every rank
        passes the same whole tensors; each keeps its shard)."""
        if assign:
            raise TitanliteError(
                "load_state_dict: assign=True has no FSDP2 meaning (the shards are FSDP's); leave it False"
            )
        kind = self._settings.state_dict_type
        if kind == StateDictType.SHARDED_STATE_DICT:
            return state_dict.load_sharded_state_dict(self.module, state, strict=strict)
        if kind == StateDictType.LOCAL_STATE_DICT:
            return state_dict.load_local_state_dict(self.module, state, strict=strict)
        return state_dict.load_full_state_dict(self.module, state, strict=strict, from_rank0=False)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
        """The wrappers in `module`; without `root_only`, also the units FSDP2 sharded inside
        them (FSDP2 modules, where FSDP1 had nested wrappers)."""
        found = wrappers_in(module, FullyShardedDataParallel)
        if root_only:
            inner = {id(m) for w in found for m in w.module.modules()}
            return [w for w in found if id(w) not in inner]
        return [m for w in found for m in (w, *w.sharded_units())]


def _units(
    module: nn.Module, policy: Any, mixed_precision: MixedPrecision | None, ignored_modules: Any, ignored_states: Any
) -> dict[str, Any]:
    """The `WrapPlan` fields of what FSDP2 shards and how: the units, innermost first, and
    those of them FSDP1 shards with mixed precision off whatever the policy says
    (`MixedPrecision._module_classes_to_ignore`, BatchNorm by default, as the MixedPrecision
    page's note says: only with an `auto_wrap_policy`, as there), the ignored parameters and
    the precision policy (checked before its classes are read)."""
    ignored, params = wrap_plan.ignored_of(ignored_modules, ignored_states)
    fields = {"mp_policy": wrap_plan.precision_of(mixed_precision), "ignored_params": params}
    units = wrap_plan.wrap_units(module, policy, ignored)
    if mixed_precision is None or policy is None:
        return {**fields, "units": units, "full_precision_units": []}
    classes = tuple(mixed_precision._module_classes_to_ignore)
    inside = {id(m) for i in ignored for m in i.modules()}
    full = [m for m in module.modules() if m is not module and isinstance(m, classes) and id(m) not in inside]
    return {**fields, "units": [*full, *(u for u in units if u not in full)], "full_precision_units": full}


def _v1_12_group(optim: Any, group: Any) -> tuple[torch.optim.Optimizer | None, Any]:
    """(optim, group) of `scatter_full_optim_state_dict`, whose fourth positional argument is
    v1.12's `group` (its signature had no `optim`) or later versions' `optim`: told by type."""
    if optim is None or isinstance(optim, torch.optim.Optimizer):
        return optim, group
    if group is not None:
        raise TitanliteError(f"optim: expected a torch.optim.Optimizer, got {type(optim).__name__}")
    return None, optim


def _refuse_local(settings: StateDictSettings, method: str) -> None:
    if settings.state_dict_type == StateDictType.LOCAL_STATE_DICT:
        raise TitanliteError(
            f"{method}: LOCAL_STATE_DICT has no optimizer form (as in FSDP1); use FULL_ or SHARDED_STATE_DICT"
        )
