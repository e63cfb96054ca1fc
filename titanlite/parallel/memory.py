"""Refuse a layout whose training state cannot fit before allocating any of it.

A user who starts the 8B preset on one GPU should read one line saying how much memory
the sharded parameters, gradients and AdamW state need and how much the device has, not
an out-of-memory traceback minutes later from the first optimizer step. The estimate is a
lower bound (activations, buffers and allocator slack come on top), so passing it does not
promise a fit; failing it proves there is none.
"""

from __future__ import annotations

import os

import torch

from titanlite.errors import TitanliteError

# fp32 master weights + fp32 gradients + AdamW exp_avg and exp_avg_sq.
TRAINING_STATE_BYTES_PER_PARAM = 4 + 4 + 8
GIB = 1024**3


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_training_state_fits(
    n_params: int, shards: int, device: torch.device, offload_to_cpu: bool, processes_per_host: int
) -> None:
    """Raise when `n_params` of training state split over `shards` ranks exceeds what one
    rank has: its GPU's memory, or its share of host memory on CPU / with CPU offload."""
    needed = n_params * TRAINING_STATE_BYTES_PER_PARAM / shards
    if device.type == "cuda" and not offload_to_cpu:
        available, where = torch.cuda.get_device_properties(device).total_memory, f"{device} has"
    else:
        available = host_memory_bytes() / processes_per_host
        where = f"each of the {processes_per_host} processes on this host gets" if processes_per_host > 1 else "this host has"
    if needed > available:
        raise TitanliteError(
            f"parallelism: {n_params / 1e9:,.2f}B parameters sharded {shards} ways need at least "
            f"{needed / GIB:,.1f} GiB per rank for fp32 weights, gradients and AdamW state, but {where} "
            f"{available / GIB:,.1f} GiB; use more ranks (data_parallel_shard_degree, tensor_parallel_degree) "
            f"or training.enable_cpu_offload"
        )
