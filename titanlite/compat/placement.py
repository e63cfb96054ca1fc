"""Where a compat wrapper shards: the `WrapPlan` fields every wrapper (`fsdp1`, `hfai`,
`megatron`) fills the same way from its process group, mesh and device arguments."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import ShardingStrategy

from titanlite.parallel.wrap_plan import build_fsdp_mesh, device_of


def placement(
    process_group: Any,
    device_mesh: DeviceMesh | None = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    fsdp_group_size: int | None = None,
    device_id: int | torch.device | None = None,
) -> dict[str, Any]:
    """The `device` (FSDP1's `device_id`; None: the current CUDA device, else the CPU), the
    `mesh` `fully_shard` gets and the `group` spanning it, as keyword arguments of `WrapPlan`."""
    device = device_of(device_id)
    mesh, group = build_fsdp_mesh(process_group, device_mesh, strategy, fsdp_group_size, device.type)
    return {"mesh": mesh, "group": group, "device": device}
