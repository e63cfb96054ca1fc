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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlite.parallel.placement import shard_indices


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


def census(specs: Counter[ShardSpec], names: tuple[str, ...], shape: tuple[int, ...]) -> ShardCensus | None:
    """Every rank's local parameter count, from DTensor's own split of each layout
    (`shard_indices` on small CPU tensors), for parameters laid out on the whole world mesh
    (`names`, `shape`); None if some parameter lives on part of it.

    Joins the fake world as each rank in turn (milliseconds a rank; its mesh is made without
    process groups, which splitting a tensor does not use), so the process group and meshes
    this process had are gone afterwards.
    """
    if any(spec.mesh_dims != names for spec in specs):
        return None
    world_size = math.prod(shape)
    per_rank, summed = [], Counter()
    for rank in range(world_size):
        init_fake_world(world_size, rank)
        mesh = DeviceMesh("cpu", torch.arange(world_size).view(shape), mesh_dim_names=names, _init_backend=False)
        held = 0
        for spec, count in specs.items():
            local = math.prod(len(index) for index in shard_indices(spec.shape, mesh, spec.placements))
            summed[spec] += local
            held += local * count
        per_rank.append(held)
    sizes = dict(zip(names, shape))
    covered = sum(summed[spec] * count // _replicas(spec, sizes) for spec, count in specs.items())
    return ShardCensus(per_rank, covered)


def _replicas(spec: ShardSpec, sizes: dict[str, int]) -> int:
    """Ranks holding each element of a layout: the product of its Replicate mesh dims."""
    replicas = 1
    for name, placement in zip(spec.mesh_dims, spec.placements):
        if placement.is_replicate():
            replicas *= sizes[name]
    return replicas
