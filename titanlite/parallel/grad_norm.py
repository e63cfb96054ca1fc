"""Total gradient norm over every mesh dimension with one all-reduce, and clipping.

`clip_grad_norm_` on DTensors reduces once per mesh dimension and fails when parameters
live on different meshes. Here each rank sums the squares of its local gradient shards,
dividing replicated shards by their replication count so each element counts once, and a
single all-reduce over the world gives the global sum.

On CPU the squares are summed with `sum()` rather than `_foreach_norm`: the CPU norm kernel
accumulates float32 without cascading and drifts by ~2e-4 relative on a million-element
gradient, enough to make the same gradients give different norms under different shardings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from titanlite.errors import TitanliteError
from titanlite.parallel.placement import local_tensor


def _replication(grad: torch.Tensor) -> int:
    """How many ranks hold identical copies of this gradient shard."""
    if not isinstance(grad, DTensor):
        return 1
    return math.prod(grad.device_mesh.size(dim) for dim, p in enumerate(grad.placements) if isinstance(p, Replicate))


def align_grads_with_params_(parameters: list[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements before the norm and the step.

    Two layouts reach here different from the parameter's: a replicated weight that saw
    only part of the computation on each rank (norm weights under tensor parallelism, with
    no FSDP to reduce them) gets a Partial gradient, which must be summed once so the norm,
    the clipping and the optimizer see the true gradient; and a vocab-sharded embedding
    table gets a Replicate gradient (DTensor's embedding backward has no row-sharded rule),
    which is sliced back to the parameter's shard, locally, so no rank keeps a full-table
    gradient. The Partial sums on one mesh go out as one all-reduce, not one per weight.
    """
    partial: dict[DeviceMesh, list[torch.nn.Parameter]] = {}
    for p in parameters:
        g = p.grad
        if not (isinstance(g, DTensor) and isinstance(p, DTensor)) or g.placements == p.placements:
            continue
        if g.device_mesh.ndim == 1 and g.placements[0] == Partial("sum") and p.placements[0] == Replicate():
            partial.setdefault(g.device_mesh, []).append(p)
        else:
            p.grad = g.redistribute(g.device_mesh, p.placements)
    for mesh, params in partial.items():
        _sum_partial_grads_(mesh, params)


def _sum_partial_grads_(mesh: DeviceMesh, params: list[torch.nn.Parameter]) -> None:
    """Replace Partial(sum) gradients on a 1-D mesh by their Replicate sums, in one all-reduce."""
    locals_ = [p.grad.to_local() for p in params]
    flat = torch.cat([t.flatten() for t in locals_])
    dist.all_reduce(flat, group=mesh.get_group())
    for p, local, summed in zip(params, locals_, flat.split([t.numel() for t in locals_])):
        p.grad = DTensor.from_local(summed.view_as(local), mesh, (Replicate(),), run_check=False)


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared elements in float32: one fused kernel on accelerators, a cascaded
    (accurate) sum per tensor on CPU."""
    if tensors[0].device.type == "cpu":
        return torch.stack([t.float().pow(2).sum() for t in tensors]).sum()
    return torch.stack([n.float() for n in torch._foreach_norm(tensors, 2.0)]).pow(2).sum()


def total_grad_norm(
    parameters: list[torch.nn.Parameter], world: bool, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The L2 norm of all gradients, as a float32 scalar on the gradients' device.

    world: the gradients are spread over every rank of `group` (None: the default group).
    """
    align_grads_with_params_(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    by_replication: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        by_replication.setdefault(_replication(g), []).append(local_tensor(g))
    for copies, locals_ in by_replication.items():
        total += _sum_of_squares(locals_) / copies
    if world and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_gradients_(
    parameters: list[torch.nn.Parameter], max_norm: float, world: bool, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale gradients so their total norm is at most max_norm (0 = measure only); returns the norm."""
    norm = total_grad_norm(parameters, world, group)
    scale_to_norm_(parameters, norm, max_norm)
    return norm


def scale_to_norm_(parameters: list[torch.nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients by max_norm / norm where that is below 1 (clipping; 0 = no clipping)."""
    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if max_norm > 0 and grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].device))


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a parallelized model: the L2 norm over every
    shard and replica on the ranks of `group` (None: all ranks, which hold the model between
    them), with one all-reduce, whatever mix of meshes the parameters live on; returns it."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm < 0:
        raise TitanliteError(f"clip_grad_norm_: max_norm must be a number >= 0 (0 = measure only), got {max_norm!r}")
    return clip_gradients_([p for p in parameters if p.requires_grad], float(max_norm), world=True, group=group)
