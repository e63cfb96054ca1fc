"""Process-group start-up: NCCL on CUDA, gloo on CPU, one device per LOCAL_RANK."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device


def world_from_env() -> tuple[int, int]:
    """(rank, world_size) as torchrun sets them; a plain `python -m` run is rank 0 of 1."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_cpu_threads(local_world_size: int) -> None:
    """Intra-op threads: OMP_NUM_THREADS when set (the launcher sets cores / processes),
    else this host's cores split between its processes, since more threads than cores
    halves matmul speed. Inter-op threads: one, since training runs no inter-op parallel
    work (autograd on CPU runs in the calling thread; gloo and DCP have their own threads)
    and idle pool threads only compete for the same cores."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cores() // local_world_size))
    if torch.get_num_interop_threads() != 1:
        torch.set_num_interop_threads(1)


def init_distributed(init_timeout_seconds: int) -> DistInfo:
    """Join the process group and pick this rank's device and CPU threads."""
    if "MASTER_ADDR" not in os.environ:  # launched without torchrun: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    rank, world_size = world_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        set_cpu_threads(local_world_size)
    dist.init_process_group(backend, timeout=timedelta(seconds=init_timeout_seconds), device_id=device if backend == "nccl" else None)
    return DistInfo(rank, world_size, local_rank, local_world_size, device)


def set_collective_timeout(seconds: int) -> None:
    """After start-up (slow: compile, first all-gathers, checkpoint load) tighten the
    timeout that turns a hung collective into an error."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds), None)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
