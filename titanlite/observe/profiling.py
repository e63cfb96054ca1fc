"""torch.profiler traces and CUDA memory snapshots of chosen steps; nothing at all when off.

Traces (`profiling.enable_profiling`): the step of every `profile_freq` (steps 10, 20, ...
with the default 10; the step before it warms the profiler up) is recorded and written as
Chrome trace JSON, one file per rank:
`<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json` (open it in
https://ui.perfetto.dev or chrome://tracing). A trace holds the step's forward and backward
ops and its FSDP/TP collectives (gloo or NCCL), on the CPU and, on GPUs, the CUDA kernels.

Memory snapshots (`profiling.enable_memory_snapshot`, CUDA only): the caching allocator
records every allocation with its stack from the first step, and its history is dumped
every `profile_freq` steps, and once more if the run runs out of memory, to
`<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>[_oom]/rank<r>_memory_snapshot.pickle`
(drag it into https://pytorch.org/memory_viz). On CPU there is no such allocator: rank 0
says so once and the run goes on.

Step numbers are the trainer's: a resumed run traces the same steps a fresh one would.

Next to each Chrome trace goes a plain-text table of the recorded step's ops by self CPU
time (`rank<r>_ops.txt`): the by-op share that docs/performance.md is written from, readable
without a trace viewer.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from titanlite.logging import logger

if TYPE_CHECKING:
    from titanlite.config import JobConfig

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events kept (torchtitan's choice): enough for several steps of a large model."""


class Stepper(Protocol):
    def step(self) -> None: ...


class _Steppers(list[Stepper]):
    """What the training loop calls once per finished step: every enabled recorder's step."""

    def step(self) -> None:
        for stepper in self:
            stepper.step()


@contextlib.contextmanager
def maybe_profile(cfg: JobConfig, rank: int, device: torch.device, start_step: int = 0) -> Iterator[Stepper]:
    """Yield an object whose `.step()` the loop calls after each step. `start_step` is the
    step training resumes from (0 for a fresh run). With both options off it starts
    nothing and `.step()` does nothing."""
    steppers = _Steppers()
    with contextlib.ExitStack() as stack:
        if cfg.profiling.enable_profiling:
            steppers.append(stack.enter_context(_traces(cfg, rank, device, start_step)))
        if cfg.profiling.enable_memory_snapshot:
            if device.type == "cuda":
                steppers.append(stack.enter_context(_MemorySnapshots(cfg, rank, start_step)))
            elif rank == 0:
                logger.warning(
                    f"profiling.enable_memory_snapshot: memory snapshots are CUDA-only; this run is on "
                    f"{device.type}, so none are written"
                )
        yield steppers


def _trace_schedule(freq: int, start_step: int, last_step: int):
    """torch.profiler's wait/warmup/active cycle of length `freq`, shifted so its active
    step is the trainer's step k * freq, and idle after `last_step` (else the profiler
    would record the shutdown as one more step). The profiler numbers the steps it has
    seen from 0; its number n is trainer step start_step + n + 1."""
    warmup = 1 if freq >= 2 else 0
    cycle = torch.profiler.schedule(wait=freq - 1 - warmup, warmup=warmup, active=1)
    return lambda n: cycle(n + start_step) if start_step + n + 1 <= last_step else torch.profiler.ProfilerAction.NONE


@contextlib.contextmanager
def _traces(cfg: JobConfig, rank: int, device: torch.device, start_step: int) -> Iterator[Stepper]:
    folder = os.path.join(cfg.job.dump_folder, cfg.profiling.save_traces_folder)

    def save_trace(prof: torch.profiler.profile) -> None:
        step = start_step + prof.step_num  # step_num has counted the step just recorded
        step_folder = os.path.join(folder, f"iteration_{step}")
        os.makedirs(step_folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(step_folder, f"rank{rank}_trace.json"))
        with open(os.path.join(step_folder, f"rank{rank}_ops.txt"), "w") as table:
            table.write(
                prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
            )
        logger.info(f"profiler: trace of step {step} written to {step_folder}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = _trace_schedule(cfg.profiling.profile_freq, start_step, cfg.training.steps)
    with warnings.catch_warnings():
        # One trace per cycle is what we want; torch warns that cycles do not accumulate.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=save_trace) as prof:
            yield prof


class _MemorySnapshots:
    """Records the CUDA allocator's history while training (the `with` block); dumps it every
    `freq` steps, and once more on an out-of-memory error in the block."""

    def __init__(self, cfg: JobConfig, rank: int, step: int):
        self.folder = os.path.join(cfg.job.dump_folder, cfg.profiling.save_memory_snapshot_folder)
        self.rank, self.freq, self.step_num = rank, cfg.profiling.profile_freq, step

    def __enter__(self) -> _MemorySnapshots:
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None and issubclass(kind, torch.OutOfMemoryError):
            self.dump(f"iteration_{self.step_num + 1}_oom")  # the step that ran out
        torch.cuda.memory._record_memory_history(enabled=None)

    def step(self) -> None:
        self.step_num += 1
        if self.step_num % self.freq == 0:
            self.dump(f"iteration_{self.step_num}")

    def dump(self, name: str) -> None:
        step_folder = os.path.join(self.folder, name)
        os.makedirs(step_folder, exist_ok=True)
        torch.cuda.memory._dump_snapshot(os.path.join(step_folder, f"rank{self.rank}_memory_snapshot.pickle"))
        logger.info(f"profiler: memory snapshot written to {step_folder}")
