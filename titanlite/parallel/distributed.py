"""Process-group start-up (NCCL on CUDA, gloo on CPU, one device per LOCAL_RANK), the
timeouts of every group the run creates, and the one line a failed collective becomes.

Timeouts: a collective that waits longer than its group's timeout raises (gloo) or aborts
the process (NCCL's watchdog). torch gives each new group its backend's default (30 min on
gloo, 10 on NCCL) whatever the default group has, so each group the run creates is adopted
here (`adopt_groups`, `new_group`) and `set_collective_timeout` moves all of them together
(`ProcessGroup.set_timeout`, public on torch 2.11 and 2.13: every backend of a group, its
future collectives): `comm.init_timeout_seconds` through start-up and the first step, then
`comm.train_timeout_seconds`.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

# Where torch issues or awaits a collective (or a pipeline's sends and receives), and where our own code is.
_COLLECTIVE_FILES = tuple(
    os.path.join("torch", "distributed", *name.split("/"))
    for name in ("distributed_c10d.py", "_functional_collectives.py", "pipelining/schedules.py", "pipelining/stage.py")
)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What gloo and NCCL say when a peer stopped answering or went away.
_PEER_TROUBLE = re.compile(r"timed out|timeout|connection (closed|reset)|broken pipe|peer", re.IGNORECASE)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device


@dataclass
class _Timeouts:
    """The groups whose timeout this run manages (the default group is always one) and the
    timeout they have now."""

    seconds: int = 0
    groups: list[dist.ProcessGroup] | None = None


_timeouts = _Timeouts()


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


def backend_for(device_type: str, cpu_offload: bool = False) -> str:
    """The process group's backend: gloo on CPU; NCCL on GPUs, with gloo beside it for CPU
    tensors when parameters and gradients are offloaded to the host (the gradient-norm
    all-reduce then runs on CPU tensors, which NCCL cannot take; torchtitan does the same)."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def init_distributed(init_timeout_seconds: int = 600, cpu_offload: bool = False) -> DistInfo:
    """Join the process group and pick this rank's device and CPU threads. A process group
    that is already up (the caller's own, or a previous run's in the same process) is
    joined as it is, with its timeout moved to `init_timeout_seconds`."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():  # this rank's GPU, made current
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:  # the CPU, with its share of the host's threads
        set_cpu_threads(local_world_size)
        device = torch.device("cpu")
    if dist.is_initialized():
        dist.group.WORLD.set_timeout(timedelta(seconds=init_timeout_seconds))
    else:
        if "MASTER_ADDR" not in os.environ:  # launched without torchrun: a world of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
        timeout = timedelta(seconds=init_timeout_seconds)
        device_id = device if device.type == "cuda" else None
        backend = backend_for(device.type, cpu_offload)
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        if "gloo" in backend:  # once, however many times a process starts a group
            atexit.unregister(_let_gloo_threads_finish)
            atexit.register(_let_gloo_threads_finish)
    _timeouts.seconds, _timeouts.groups = init_timeout_seconds, [dist.group.WORLD]
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, local_world_size, device)


def _let_gloo_threads_finish() -> None:
    """At exit, release the GIL for a moment before the interpreter finalizes. gloo's
    run-loop threads destroy each collective's work after the caller's wait has returned,
    and a tensor the work holds whose Python object is still alive is freed there, under
    the GIL. A process that exits right after its last collective (a barrier, then
    `destroy_process_group`) can start finalizing first; the thread asking for the GIL is
    then ended inside that destructor, and std::terminate aborts the rank ("terminate called
    without an active exception": 3 of 30 runs of examples/hfai_style.py on torch 2.13).
    torch's own fix, an exit hook of the same kind (pytorch#179291), was abandoned."""
    time.sleep(0.05)


def adopt_groups(groups: Iterable[dist.ProcessGroup | None]) -> None:
    """Give groups created elsewhere (a device mesh's) the current timeout, and keep them
    for `set_collective_timeout`. None (a world of one) is skipped."""
    if _timeouts.groups is None:
        return
    for group in groups:
        if group is not None and not any(group is known for known in _timeouts.groups):
            group.set_timeout(timedelta(seconds=_timeouts.seconds))
            _timeouts.groups.append(group)


def new_group(**kwargs: Any) -> dist.ProcessGroup:
    """`dist.new_group` with the current timeout, adopted (see `adopt_groups`); torch's
    default timeout where the process group was not started by `init_distributed`."""
    group = dist.new_group(timeout=collective_timeout(), **kwargs)
    adopt_groups([group])
    return group


def collective_timeout() -> timedelta | None:
    """The timeout every group of this run has now (None: not managed by `init_distributed`)."""
    return timedelta(seconds=_timeouts.seconds) if _timeouts.groups is not None else None


def set_collective_timeout(seconds: int) -> None:
    """Move every group of this run to a new timeout: after start-up (slow: compile, first
    all-gathers, checkpoint load) the tighter one that turns a hung collective into an error."""
    _timeouts.seconds = seconds
    for group in _timeouts.groups or []:
        group.set_timeout(timedelta(seconds=seconds))


class CollectiveFailure(NamedTuple):
    """What `collective_failure` found: the line to print, and whether a peer stopped
    answering (a timeout) rather than died (its connection closed)."""

    line: str
    timed_out: bool


def collective_failure(error: BaseException) -> CollectiveFailure | None:
    """The failure of a collective whose peer stopped answering or died, as one line naming
    the collective, its group when known, and where our code waited for it; None for any
    other error (a bug keeps its traceback).

    gloo raises a plain RuntimeError from inside the c10d call (found in the traceback,
    whose frame also holds the `group` argument) or from the wait of an async functional
    collective (tensor parallel); NCCL and the stores raise DistError. A wrapper that raises
    its own error from it (a pipeline stage's "[Stage 0] failed to run forward") is seen
    through: its causes are read in turn, each with the frames that led to it.
    """
    frames: list[FrameType] = []
    while error is not None:
        frames += [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
        if (failure := _failure(error, frames)) is not None:
            return failure
        error = error.__cause__
    return None


def _failure(error: BaseException, frames: list[FrameType]) -> CollectiveFailure | None:
    """`collective_failure` of one error of the chain, reached through `frames`."""
    torch_frame = next((f for f in reversed(frames) if f.f_code.co_filename.endswith(_COLLECTIVE_FILES)), None)
    text = str(error)
    if not isinstance(error, dist.DistError) and (torch_frame is None or not _PEER_TROUBLE.search(text)):
        return None
    # Our frame: the last of ours that called into torch (a pipeline's wait is ours, inside torch's schedule).
    callers = frames[: frames.index(torch_frame)] if torch_frame is not None else frames
    ours = next((f for f in reversed(callers) if f.f_code.co_filename.startswith(_PACKAGE_DIR)), None)
    what = _describe(torch_frame, ours)
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return CollectiveFailure(f"{what} timed out after {_timeouts.seconds} s: a peer rank stopped answering", True)
    if re.search(r"connection (closed|reset)|broken pipe", text, re.IGNORECASE):
        return CollectiveFailure(f"{what} failed: a peer rank closed its connection (it died)", False)
    first_line = next((line for line in text.splitlines() if line.strip()), type(error).__name__)
    return CollectiveFailure(f"{what} failed: {first_line}", False)


def _describe(torch_frame: FrameType | None, our_frame: FrameType | None) -> str:
    """ "all_gather_single on group mesh_tp (waited for in forward, titanlite/models/...:146)"."""
    what = "a collective"
    if torch_frame is not None and os.path.join("distributed", "pipelining") in torch_frame.f_code.co_filename:
        what = f"a pipeline send/receive in {torch_frame.f_code.co_name}"
    elif torch_frame is not None:
        what = torch_frame.f_code.co_name
        if "group" in torch_frame.f_locals:
            what += f" on group {_group_name(torch_frame.f_locals['group'])}"
    if our_frame is not None:
        where = os.path.relpath(our_frame.f_code.co_filename, os.path.dirname(_PACKAGE_DIR))
        what += f" (waited for in {our_frame.f_code.co_name}, {where}:{our_frame.f_lineno})"
    return what


def _group_name(group: dist.ProcessGroup | None) -> str:
    """The group's description: "default_pg", "mesh_tp", "mesh_dp", "checkpoint", ..."""
    return "default_pg" if group is None else getattr(group, "group_desc", None) or getattr(group, "group_name", "?")


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _timeouts.groups = None
