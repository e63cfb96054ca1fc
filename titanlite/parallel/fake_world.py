"""One rank of a large world in this process: a fake process group, for the planner.

With `torch.distributed`'s "fake" backend a CPU process believes it is rank r of N:
device meshes, `parallelize_module` and `fully_shard` run unchanged and collectives do
nothing, so the real parallelize path shows exactly what rank r would hold.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore


def init_fake_world(world_size: int, rank: int) -> None:
    """Join a fake process group as `rank` of `world_size` (replacing any earlier one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out: the same on every rank, whatever the rank holds."""

    shape: tuple[int, ...]
    mesh_dims: tuple[str, ...]
    placements: tuple[Placement, ...]


def shard_specs(model: nn.Module) -> Counter[ShardSpec]:
    """The distinct layouts of the model's DTensor parameters, with how many share each."""
    return Counter(
        ShardSpec(tuple(p.shape), tuple(p.device_mesh.mesh_dim_names), tuple(p.placements))
        for p in model.parameters()
        if isinstance(p, DTensor)
    )


@dataclass(frozen=True)
class ShardCensus:
    """Local parameter elements of every rank, and what they add up to."""

    per_rank: list[int]
    covered: int  # sum over ranks of each tensor's local elements / the ranks replicating it


def census(
    specs: Counter[ShardSpec], names: tuple[str, ...], shape: tuple[int, ...], ep: int = 1
) -> ShardCensus | None:
    """Every rank's local parameter count, from DTensor's own local shape of each layout
    (the helper behind `compute_local_shape_and_global_offset`, which DCP also plans by, given
    the rank's coordinate instead of a mesh), for parameters laid out on the whole world mesh
    (`names`, `shape`) or, with expert parallelism (`ep` > 1), on its experts' view of it
    (`expert_view`); None if some parameter lives on another part of it.

    Pure arithmetic per rank: no process group or mesh is made for the other ranks (joining a
    fake world and meshing it as each of 512 ranks cost seconds), and this process's are kept.
    """
    views = [(names, shape)] + ([expert_view(names, shape, ep)] if ep > 1 else [])
    layouts = {}
    for spec in specs:
        view = next((v for v in views if set(spec.mesh_dims) <= set(v[0])), None)
        if view is None or (view[0] == names and spec.mesh_dims != names):
            return None
        placements = dict(zip(spec.mesh_dims, spec.placements))
        layouts[spec] = (view, tuple(placements.get(name, Replicate()) for name in view[0]))
    per_rank, summed = [], Counter()
    ranks = torch.arange(math.prod(shape))  # each rank's coordinate in each view: the world's ranks in its order
    coordinates = {v: torch.stack(torch.unravel_index(ranks, v[1]), dim=1).tolist() for v in views}
    for rank in range(len(ranks)):
        held = 0
        for spec, count in specs.items():
            view, placements = layouts[spec]
            at = coordinates[view][rank]
            # skip_offset=True (the last argument): the local shape only
            local = math.prod(_compute_local_shape_and_global_offset(spec.shape, view[1], at, placements, True)[0])
            summed[spec] += local
            held += local * count
        per_rank.append(held)
    covered = sum(summed[spec] * count // _replicas(*layouts[spec]) for spec, count in specs.items())
    return ShardCensus(per_rank, covered)


def expert_view(names: tuple[str, ...], shape: tuple[int, ...], ep: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The world mesh as expert parallelism sees it, in the same rank order: dp_shard x cp
    (adjacent, either may be absent) unflattened into ("efsdp", "ep"), ep innermost
    (parallel/mesh.py)."""
    inner = [i for i, name in enumerate(names) if name in ("dp_shard", "cp")]
    first, last = inner[0], inner[-1] + 1
    ranks = math.prod(shape[first:last])
    return (names[:first] + ("efsdp", "ep") + names[last:], shape[:first] + (ranks // ep, ep) + shape[last:])


def _replicas(view: tuple[tuple[str, ...], tuple[int, ...]], placements: tuple[Placement, ...]) -> int:
    """Ranks holding each element of a layout: the product of its Replicate mesh dims."""
    return math.prod(size for size, placement in zip(view[1], placements) if placement.is_replicate())
