"""A rank's shard of a DTensor: its local tensor, a local tensor laid out as a DTensor again,
and which global indices it holds, asked of DTensor itself.

For the shard-sized initialization (`models/init.py`: generate only the values this rank
holds), so it reads a layout exactly as the training run lays it out. (The planner's census
needs only shard sizes: `parallel/fake_world.py` asks DTensor's local-shape helper.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself under no_grad: writes reach the DTensor);
    a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_like(shard: torch.Tensor, param: DTensor) -> DTensor:
    """A local shard as a DTensor laid out as `param` (its mesh, placements, global shape and stride)."""
    return DTensor.from_local(shard, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def shard_indices(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> list[torch.Tensor]:
    """The global indices this rank's local shard holds, one tensor per dim, of a tensor of
    `shape` laid out by `placements` on `mesh` (a DTensor parameter's spec).

    Asks DTensor itself, so every placement it supports (Shard, FSDP's _StridedShard over
    TP shards, uneven splits, Replicate) is read exactly: for each dim d, a vector whose
    entries are their own index is sharded like d is (other dims' shards, which do not move
    indices along d, are replaced by Replicate), without communication.
    """
    indices = []
    for dim, size in enumerate(shape):
        # Shard, _StridedShard have .dim
        along = [p if getattr(p, "dim", None) == dim else Replicate() for p in placements]
        if all(isinstance(p, Replicate) for p in along):
            indices.append(torch.arange(size))
            continue
        ramp = torch.arange(size).view([size if d == dim else 1 for d in range(len(shape))])
        indices.append(distribute_tensor(ramp, mesh, along, src_data_rank=None).to_local().flatten())
    return indices
