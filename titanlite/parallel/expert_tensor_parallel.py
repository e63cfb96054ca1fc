"""Expert tensor parallelism (`expert_tensor_parallel_degree`, torchtitan's key): each routed
expert's weights split over the tp ranks, Megatron's MLP split, instead of whole on every tp
rank.

Under tensor parallelism a mixture-of-experts layer runs whole on each tp rank, on the same
tokens (`tensor_parallel.WholeOnEachRank`): every tp rank routes them alike and, without this,
computes every routed expert in full, duplicating the work and the memory. Here the experts'
input projections (w1, w3: [E, hidden, dim]) are split column-wise, along hidden, and the
output projection (w2: [E, dim, hidden]) row-wise, along the same hidden, so each tp rank
computes its slice of every expert's hidden layer for all the routed rows, and the partial
outputs are summed over tp. Which dim of which weight is hidden is the experts module's to say
(`TensorParallelExperts.tensor_parallel_dims`).

The token exchange around the experts is Megatron's pair of conjugate collectives: the routed
rows enter through an identity whose backward all-reduces their gradient over tp (each rank's
slice gives part of it), and the outputs leave through an all-reduce whose backward is the
identity (every rank gets the same full output gradient). Under expert parallelism this runs
inside each ep rank's computation, after the all-to-all brought the rows (the exchange is
per tp index, with the same rows on every tp rank). The weights are DTensors, Shard(dim) over
tp (and Shard(0) over ep first), so checkpoints hold the stacked `[E, ...]` tensors at any layout.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from titanlite.errors import TitanliteError


@runtime_checkable
class TensorParallelExperts(Protocol):
    """A routed-experts module expert tensor parallelism can split (models/moe_experts.GroupedExperts)."""

    # parameter name -> the dim of its hidden (intermediate) size: the one split over tp
    tensor_parallel_dims: dict[str, int]


class _IntoTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the input gradient's slices over the tp group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _OutOfTensorParallel(torch.autograd.Function):
    """Forward sums the partial outputs over the tp group; backward is the identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def refuse_unsplittable(experts: nn.Module) -> None:
    """One line for a parameter of `experts` without a hidden dim to split over tp (gpt-oss's
    output bias: each tp rank's partial output would add it again). The planner calls it too."""
    for name, _ in experts.named_parameters(recurse=False):
        if name not in experts.tensor_parallel_dims:
            raise TitanliteError(
                f"parallelism.expert_tensor_parallel_degree: {type(experts).__name__}'s {name} has no "
                "tensor-parallel split (set it to 1: the experts whole on each tp rank)"
            )


def tp_placement(experts: nn.Module, name: str, split: bool) -> Shard | Replicate:
    """How parameter `name` of `experts` lies over tp: Shard(its hidden dim) when split, else
    Replicate (each tp rank computes the whole expert)."""
    if not split:
        return Replicate()
    refuse_unsplittable(experts)
    return Shard(experts.tensor_parallel_dims[name])


def exchange_over_tp(experts: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The routed rows pass into tp before the experts' forward and their partial outputs
    are summed out of it after (see the module docstring)."""
    group = tp_mesh.get_group()
    experts.register_forward_pre_hook(lambda _, inputs: (_IntoTensorParallel.apply(inputs[0], group), *inputs[1:]))
    experts.register_forward_hook(lambda _, inputs, out: _OutOfTensorParallel.apply(out, group))
