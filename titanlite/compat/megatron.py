"""Megatron-core's `TorchFullyShardedDataParallel` (FSDP2 under Megatron's signature) on
titanlite's core: code written for it changes only its import line,

    from titanlite.compat.megatron import TorchFullyShardedDataParallel

Built as Megatron's own class builds (megatron/core/distributed/torch_fully_sharded_data_parallel.py):
- every submodule that is an instance of a class in `sub_modules_to_wrap`, or of a class
  some submodule lists in its `_fsdp_modules` attribute, is sharded on its own (nested
  ones innermost first), then the root; `sub_modules_to_wrap` defaults to Megatron's set
  (TransformerLayer, LanguageModelEmbedding, RotaryEmbedding, ColumnParallelLinear) where
  megatron-core is installed; without it a model holds none of them and only the root is
  sharded, as Megatron's class would do. One difference: a layer that returns its bias for
  its caller to add (`skip_bias_add`, as the local spec's `linear_fc1` under the default
  `transformer_impl`) stays in its parent's unit (see `_hands_out_bias`);
- from `config` (TransformerConfig) only `transformer_impl` ("local": ColumnParallelLinear
  leaves the default set) and `recompute_granularity` (not None: each unit prefetches the
  one before it in backward explicitly, since recompute reorders FSDP2's implicit order);
  from `ddp_config` only `reshard_after_forward` (default True). So megatron-core's config
  objects and plain stand-ins with those attribute names both work;
- `process_group` defaults to Megatron's data-parallel group with context parallelism
  where megatron's `parallel_state` is initialized, else every rank;
- attributes Megatron sets on parameters (`tensor_model_parallel`, `sequence_parallel`,
  `allreduce`, ...) survive sharding.
Methods are `_BaseDataParallel`'s; where Megatron's does nothing on FSDP2 (`finish_grad_sync`,
`start_grad_sync`, `broadcast_params`: FSDP2 reduces in backward and holds one copy per shard),
so does this one, with the signatures megatron-core's `finalize_model_grads` calls. `no_sync`
really skips the reduction (Megatron's base class documents that, though its FSDP2 class reduces
anyway; the sum is the same), and `disable_bucketing` is accepted and unused, as in Megatron's
class.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.compat.placement import placement
from titanlite.parallel import state_dict, wrap_plan
from titanlite.parallel.wrapper import ShardedWrapper

__all__ = ["TorchFullyShardedDataParallel", "MEGATRON_DEFAULT_SUB_MODULES"]

# `sub_modules_to_wrap`'s default: Megatron's own set, looked up when a wrapper is built
# (importing megatron-core takes seconds), not when this module is imported.
MEGATRON_DEFAULT_SUB_MODULES = frozenset({"megatron-core's default set"})


def megatron_default_sub_modules() -> set[type]:
    """Megatron's default `sub_modules_to_wrap` where megatron-core is installed, else none."""
    try:
        from megatron.core import tensor_parallel
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.transformer.transformer_layer import TransformerLayer
    except ImportError:
        return set()
    return {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding, tensor_parallel.ColumnParallelLinear}


class TorchFullyShardedDataParallel(ShardedWrapper):
    """Megatron-core's FSDP2 wrapper (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        ddp_config: Any,
        module: nn.Module,
        sub_modules_to_wrap: Any = MEGATRON_DEFAULT_SUB_MODULES,
        disable_bucketing: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ):
        wrap_plan.require_process_group("TorchFullyShardedDataParallel")
        classes = _classes_to_wrap(sub_modules_to_wrap, config, module)
        plan = wrap_plan.WrapPlan(
            **placement(process_group or _megatron_data_parallel_group()),
            units=[u for u in wrap_plan.wrap_units(module, classes, set()) if not _hands_out_bias(u)],
            reshard_after_forward=wrap_plan.reshard_of(getattr(ddp_config, "reshard_after_forward", True)),
            backward_prefetch="previous" if getattr(config, "recompute_granularity", None) is not None else "default",
        )
        attributes = {name: dict(vars(p)) for name, p in module.named_parameters()}  # FSDP2 makes new parameters
        super().__init__(module, plan)
        for name, p in module.named_parameters():
            for key, value in attributes.get(name, {}).items():
                setattr(p, key, value)
        self.config, self.ddp_config, self.process_group, self.device_mesh = config, ddp_config, plan.group, plan.mesh

    def start_grad_sync(self, *unused: Any) -> None:
        """FSDP2 reduces each unit's gradients during backward: nothing is left to start."""

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Nothing is left to wait for (see `start_grad_sync`); `force_all_reduce`, which
        megatron-core's `finalize_model_grads` passes, changes nothing either."""

    def broadcast_params(self) -> None:
        """Each rank holds its own shard, not a copy to sync; nothing to broadcast."""

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient by `scaling_factor`."""
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Drop every gradient (FSDP2 keeps them on the parameters, not in a buffer)."""
        self.module.zero_grad(set_to_none=True)

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination: Any = None) -> dict[str, Any]:
        """The module's state with FSDP2's DTensor shards (for torch.distributed.checkpoint)."""
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars, destination=destination)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        save = getattr(self.module, "state_dict_for_save_checkpoint", None)
        return save(prefix=prefix, keep_vars=keep_vars) if save is not None else self.state_dict(prefix, keep_vars)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> Any:
        """A sharded state (DTensors, as `state_dict()` gives and DCP loads in place) or a
        whole one (plain tensors, every rank the same). Megatron's own method does nothing,
        because DCP has already loaded the shards in place; loading them again is the same."""
        if any(isinstance(v, DTensor) for v in state.values()):
            return state_dict.load_sharded_state_dict(self.module, state, strict=strict)
        return state_dict.load_full_state_dict(self.module, state, strict=strict, from_rank0=False)


def _classes_to_wrap(sub_modules_to_wrap: Any, config: Any, module: nn.Module) -> set:
    """The classes whose instances are units: `sub_modules_to_wrap` (Megatron's default set,
    one class or class name, or a collection of them), less ColumnParallelLinear under the
    "local" `transformer_impl`, plus what any submodule lists in `_fsdp_modules`."""
    if sub_modules_to_wrap is MEGATRON_DEFAULT_SUB_MODULES:
        classes = megatron_default_sub_modules()
    elif isinstance(sub_modules_to_wrap, (str, type)):  # one class or class name, not its letters
        classes = {sub_modules_to_wrap}
    else:
        classes = set(sub_modules_to_wrap)
    if getattr(config, "transformer_impl", None) == "local":
        classes = {c for c in classes if getattr(c, "__name__", c) != "ColumnParallelLinear"}
    for sub_module in module.modules():
        classes.update(getattr(sub_module, "_fsdp_modules", []))
    return classes


def _hands_out_bias(module: nn.Module) -> bool:
    """A layer that returns its bias for the caller to add (Megatron's `skip_bias_add`, as the
    local spec's `linear_fc1`): the caller reads that bias after the layer's forward, when a
    unit of its own has already resharded it (freed storage: a segfault on CPU), so such a
    layer stays in its parent's unit, which holds it gathered until the add is done."""
    return bool(getattr(module, "skip_bias_add", False)) and getattr(module, "bias", None) is not None


def _megatron_data_parallel_group() -> dist.ProcessGroup | None:
    """Megatron's data-parallel group (with context parallelism) when its parallel state is up."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=True)
