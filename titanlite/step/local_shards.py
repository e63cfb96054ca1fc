"""Optimizer steps on the local shards of DTensor parameters.

An elementwise update (AdamW's; Muon's momentum and its AdamW) of a DTensor parameter is the
same update of its local shard, given the local shards of its gradient and state laid out
alike. Stepping the shards skips DTensor's dispatch, whose sharding propagation for a fused or
foreach kernel over a list of DTensors misses its cache on the first step of every new layout
or model: 0.13-0.50 s of CPU per rank on 4-rank debug-model layouts, 2.6 s on a 16-rank MoE one,
about a tenth of a 3-step test run (docs/performance.md, "What changed", 6).
The state stays DTensors laid out as their parameters, which checkpoints save and reshard.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from titanlite.parallel.placement import local_tensor, shard_like


def like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The gradient laid out as its parameter (a TP embedding's gradient can arrive Replicate),
    as DTensor's dispatch would redistribute it inside the update."""
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


class AdamW(torch.optim.AdamW):
    """torch's AdamW (fused, foreach or for-loop kernels, its numbers bit for bit), each step
    taken on the local shards of DTensor parameters.

    For the step, each DTensor parameter in the groups is replaced by its local shard holding
    its gradient's shard (laid out as the parameter), and its state by the state's shards,
    which the step updates in place; state the step creates (the first step's) is wrapped as
    DTensors laid out as its parameter, all but torch's scalar step count."""

    def step(self, closure=None):
        swapped = {}  # id(shard): (shard, its parameter, the parameter's state before the step)
        with torch.no_grad():
            for group in self.param_groups:
                group["params"] = [self._swap_in(p, swapped) if isinstance(p, DTensor) else p for p in group["params"]]
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                group["params"] = [swapped[id(p)][1] if id(p) in swapped else p for p in group["params"]]
            for shard, param, state in swapped.values():
                shard.grad, created = None, self.state.pop(shard, {})
                if state or created:
                    self.state[param] = state or {
                        k: v if k == "step" else shard_like(v, param) for k, v in created.items()
                    }

    def _swap_in(self, param: DTensor, swapped: dict) -> torch.Tensor:
        shard = param.to_local()
        shard.grad = None if param.grad is None else local_tensor(like_param(param.grad, param))
        if state := self.state.pop(param, None):
            self.state[shard] = {key: local_tensor(value) for key, value in state.items()}
        swapped[id(shard)] = (shard, param, state)
        return shard
