"""hfai's `hfai.distributed.fsdp.FullyShardedDataParallel` on FSDP2: code written for it
changes only its import line,

    from titanlite.compat.hfai import FullyShardedDataParallel as FSDP

with hfai's signature, defaults and state-dict semantics, which differ from FSDP1's:
- `reshard_after_forward=True` and `backward_prefetch=None` (no backward prefetch) by
  default; `fsdp_group_size` shards within groups of that many ranks and replicates across
  them (hybrid sharding);
- `model.summon_full_params()` is a method of the instance: inside it `state_dict()` is the
  whole model's (`module.state_dict()` of whole tensors, loadable by the unwrapped model)
  and `load_state_dict(full)` writes a whole state into the shards;
- outside it, `state_dict()` is each rank's own pieces (`torch.save(state, f"model{rank}.pt")`)
  and `load_state_dict` takes them back at the same layout.
The policies hfai code imports beside the class are re-exported, and `titanlite.compat.hfai.warp`
stands for `hfai.distributed.fsdp.warp`, where hfai code imports them from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from titanlite.compat.placement import placement
from titanlite.errors import TitanliteError
from titanlite.parallel import full_params, state_dict, wrap_plan
from titanlite.parallel.wrapper import ShardedWrapper

__all__ = [
    "FullyShardedDataParallel",
    "BackwardPrefetch",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]


class FullyShardedDataParallel(ShardedWrapper):
    """hfai's wrapper over FSDP2 (see the module docstring for its semantics)."""

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        auto_wrap_policy: Any = None,
        reshard_after_forward: bool | int = True,
        backward_prefetch: BackwardPrefetch | None = None,
        forward_prefetch: bool = False,
        fsdp_group_size: int | None = None,
        _is_root: bool = True,
    ):
        wrap_plan.require_process_group("FullyShardedDataParallel")
        if _is_root is not True:
            raise TitanliteError(
                "_is_root: only a root wrapper is built by hand; nested units come from auto_wrap_policy"
            )
        plan = wrap_plan.WrapPlan(
            **placement(process_group, fsdp_group_size=fsdp_group_size),
            units=wrap_plan.wrap_units(module, auto_wrap_policy, set()),
            reshard_after_forward=wrap_plan.reshard_of(reshard_after_forward),
            backward_prefetch=wrap_plan.backward_prefetch_of(backward_prefetch),
            forward_prefetch=wrap_plan.forward_prefetch_of(forward_prefetch),
        )
        super().__init__(module, plan)
        self._whole = False

    @contextlib.contextmanager
    def summon_full_params(
        self,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Whole parameters inside the block, where `state_dict()` / `load_state_dict()` are
        the whole model's; edits (and loads) are written back to the shards on exit."""
        with full_params.summon_full_params(self, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            self._whole = True
            try:
                yield
            finally:
                self._whole = False

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """Inside `summon_full_params`: the whole model's (`module.state_dict()`). Outside:
        this rank's own pieces, plain tensors to `torch.save` per rank."""
        result = (
            self.module.state_dict(keep_vars=keep_vars) if self._whole else state_dict.local_state_dict(self.module)
        )
        destination = {} if destination is None else destination
        destination.update({prefix + k: v for k, v in result.items()})
        return destination

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> tuple[list[str], list[str]]:
        """Inside `summon_full_params`: a whole state (the unwrapped model's) copied into the
        whole parameters, which the block's exit writes into the shards. Outside: this rank's
        pieces from a `state_dict()` taken outside it at the same layout."""
        if not self._whole:
            return state_dict.load_local_state_dict(self.module, state, strict=strict)
        return state_dict.copy_into(
            self.module.state_dict(keep_vars=True), state, strict, "a whole state dict is the unwrapped model's"
        )
