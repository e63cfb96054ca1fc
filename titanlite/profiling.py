"""Optional torch.profiler traces every `profiling.profile_freq` steps, one file per rank.

Next to each Chrome trace goes a plain-text table of the recorded step's ops by self CPU
time (`rank<r>_ops.txt`): the by-op share that docs/performance.md is written from, readable
without a trace viewer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from titanlite.logging import logger


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(cfg, rank: int) -> Iterator[object]:
    """Yield an object with `.step()`: a torch profiler recording the last step of every
    `profile_freq` window (after a few warm-up steps), or a no-op."""
    if not cfg.profiling.enable_profiling:
        yield _NoProfiler()
        return
    folder = os.path.join(cfg.job.dump_folder, cfg.profiling.save_traces_folder)
    freq = cfg.profiling.profile_freq
    warmup, active = (1, 1) if freq >= 3 else (0, 1)

    def save_trace(prof: torch.profiler.profile) -> None:
        step_folder = os.path.join(folder, f"iteration_{prof.step_num}")
        os.makedirs(step_folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(step_folder, f"rank{rank}_trace.json"))
        with open(os.path.join(step_folder, f"rank{rank}_ops.txt"), "w") as table:
            table.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
        logger.info(f"profiler trace written to {step_folder}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=freq - warmup - active, warmup=warmup, active=active)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=save_trace) as prof:
        yield prof
