"""A step saved again over its own folder by 2 ranks, one rank's part: `run_checks` runs as a
case of test_parallel_equivalence.py's 2-rank session (session_worker.py), no process start of
its own.

Rank 0 moves the old folder aside (`commit.retire`, slowed here by 0.5 s) and every rank's DCP
writer makes the folder again in its local planning (`prepare_local_plan`, before any
collective). Each rank records when its writer made the folder and rank 0 when its retire
ended: every rank must make it after the retire. When the other ranks did not wait, rank 1
made the folder during the retire (and, in a narrower window, failed with FileExistsError:
mkdir found the old folder, is_dir no longer did; seen once in a full suite run).
"""

from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem

from titanlite.checkpoint import commit
from titanlite.checkpoint.checkpointer import Checkpointer


def run_checks() -> dict:
    folder = [tempfile.mkdtemp(prefix="overwrite-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    torch.manual_seed(0)
    checkpointer = Checkpointer(folder[0], model=torch.nn.Linear(4, 4), async_mode="disabled")
    checkpointer.save(1, blocking=True)
    times: dict[str, float] = {}
    retire, plan = commit.retire, filesystem._FileSystemWriter.prepare_local_plan

    def slow_retire(root, step):
        time.sleep(0.5)
        retired = retire(root, step)
        times["retired"] = time.time()
        return retired

    def recorded_plan(writer, save_plan):
        times.setdefault("made", time.time())
        return plan(writer, save_plan)

    commit.retire, filesystem._FileSystemWriter.prepare_local_plan = slow_retire, recorded_plan
    try:
        checkpointer.save(1, blocking=True)
    finally:
        commit.retire, filesystem._FileSystemWriter.prepare_local_plan = retire, plan
        checkpointer.close()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {"ranks": gathered, "committed": commit.read_commit(commit.step_dir(folder[0], 1)) is not None}
