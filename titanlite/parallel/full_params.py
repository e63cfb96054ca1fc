"""FSDP1's `summon_full_params` on FSDP2 (or any DTensor) parameters: whole parameters in
place of the shards for the duration of a `with` block, optionally written back.

Each DTensor parameter is all-gathered (`full_tensor()`, every rank takes part) and put in
its module's place as a plain `nn.Parameter`; on exit the shards are put back, and with
`writeback` each rank copies its own slice of the (possibly edited) whole tensor into its
shard, computed locally (no communication). Tied parameters stay tied: one whole tensor per
shared parameter. Forward and backward are not meant to run inside the block (as in FSDP1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.errors import TitanliteError


def _gather(p: DTensor, offload_to_cpu: bool, with_grads: bool) -> nn.Parameter:
    whole = p.full_tensor().detach()
    if whole.untyped_storage().data_ptr() == p.to_local().untyped_storage().data_ptr():
        whole = whole.clone()  # a mesh of one gathers nothing: edits must not reach the shard unless written back
    full = nn.Parameter(whole.cpu() if offload_to_cpu else whole, requires_grad=p.requires_grad)
    if with_grads and isinstance(p.grad, DTensor):
        grad = p.grad.full_tensor()
        full.grad = grad.cpu() if offload_to_cpu else grad
    return full


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Whole parameters inside the block (on rank 0 only with `rank0_only`, in host memory
    with `offload_to_cpu`, with whole gradients with `with_grads`); `writeback` keeps edits.
    Every rank of the model's mesh must enter it (the gather is collective)."""
    if not recurse:
        raise TitanliteError(
            "summon_full_params: recurse=False has no FSDP2 meaning (units share one model); leave it True"
        )
    if rank0_only and writeback:
        raise TitanliteError(
            "summon_full_params: writeback=True with rank0_only=True (other ranks hold nothing to "
            "write back); pass writeback=False"
        )
    # (owner, attribute name, sharded parameter) of every DTensor parameter, tied ones once per owner
    slots = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if isinstance(p, DTensor)]
    sharded = {id(p): p for _, _, p in slots}  # each tied parameter once, in the model's order
    full = {key: _gather(p, offload_to_cpu, with_grads) for key, p in sharded.items()}
    if not rank0_only or not dist.is_initialized() or dist.get_rank() == 0:  # swap the whole ones in
        for owner, name, p in slots:
            owner._parameters[name] = full[id(p)]
    try:
        yield
    finally:
        for owner, name, p in slots:
            owner._parameters[name] = p
        if writeback:
            _write_back(sharded, full)


@torch.no_grad()
def _write_back(sharded: dict[int, DTensor], full: dict[int, nn.Parameter]) -> None:
    """Each rank's slice of the whole tensor into its shard (`src_data_rank=None`: sliced
    locally, nothing sent)."""
    for key, p in sharded.items():
        whole = full[key].detach().to(device=p.device, dtype=p.dtype)
        p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local())
