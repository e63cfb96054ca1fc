"""A user's step participant (titanlite/step/participants.py) joins the real trainer through
its public seam, `Trainer(plan, participants=[...])`, without a line of trainer.py changed, and
sees every point of every step in order: on one process and under pipeline parallelism (2
ranks, each its own stage). Its field joins the step line and the returned history. One
session per world size (tests/helpers/sessions.py), each rank running `record_calls`."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import timeout_scale
from tests.helpers.sessions import Case, SessionResult, run_session
from titanlite.build import plan_run
from titanlite.config import load_config
from titanlite.observe.metrics import LineField
from titanlite.step.participants import StepParticipant
from titanlite.trainer import Trainer

STEPS = 3
TIMEOUT_S = {1: 240, 2: 360}
ARGS = [
    "--config",
    "debug_model",
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--metrics.log_freq",
    "2",
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.interval",
    "2",
    "--validation.enable",
    "true",
    "--validation.freq",
    "2",
    "--validation.steps",
    "1",
]
PP = ["--parallelism.pipeline_parallel_degree", "2"]


class Recorder(StepParticipant):
    """Notes each call it gets, as (point, arguments); adds `recorded_calls N` to the step line."""

    def __init__(self) -> None:
        self.calls: list[list] = []

    def resume(self, step: int) -> None:
        self.calls.append(["resume", step])

    def before_step(self, step: int, redo: bool = False) -> None:
        self.calls.append(["before_step", step, redo])

    def after_backward(self, params: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        self.calls.append(["after_backward", all(p.grad is not None for p in params)])
        return loss

    def commit(self, step: int) -> bool:
        self.calls.append(["commit", step])
        return True

    def after_optimizer_step(self, updated: bool) -> None:
        self.calls.append(["after_optimizer_step", updated])

    def log_fields(self) -> list[LineField]:
        self.calls.append(["log_fields"])
        return [LineField(f"recorded_calls {len(self.calls)}", {"recorded_calls": float(len(self.calls))})]

    def after_step(self, step: int, last: bool) -> None:
        self.calls.append(["after_step", step, last])

    def close(self) -> None:
        self.calls.append(["close"])


def expected_calls() -> list[list]:
    """Every point of a fresh 3-step run, logging steps 1, 2 and 3 (the first, log_freq 2, the last)."""
    calls: list[list] = [["resume", 0]]
    for step in range(1, STEPS + 1):
        calls += [["before_step", step, False], ["after_backward", True], ["commit", step]]
        calls += [["after_optimizer_step", True], ["log_fields"], ["after_step", step, step == STEPS]]
    return calls + [["close"]]


def record_calls(extra: list[str]) -> dict:
    """On every rank: train with a Recorder in a fresh dump folder (rank 0's, shared)."""
    folder = [tempfile.mkdtemp(prefix="titanlite-participants-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    recorder = Recorder()
    plan = plan_run(load_config([*ARGS, *extra, "--job.dump_folder", folder[0]]), dist.get_world_size())
    trainer = Trainer(plan, participants=[recorder])
    try:
        history = trainer.train()
    finally:
        trainer.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, recorder.calls)
    return {"ranks": ranks, "history": history}


def one_process() -> dict:
    return record_calls([])


def two_stages() -> dict:
    return record_calls(PP)


def session(nproc: int, function: str, folder) -> SessionResult:
    return run_session(nproc, [Case(function, [], call=f"{__name__}:{function}")], folder, TIMEOUT_S[nproc])


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S[1] * timeout_scale() + 60)
def test_a_participant_sees_every_point_of_every_step_on_one_process(tmp_path):
    checks = session(1, "one_process", tmp_path)["one_process"]["checks"]
    assert checks["ranks"] == [expected_calls()]
    assert [h["step"] for h in checks["history"]] == [1, 2, 3]
    # its field is in each logged step's scalars: the calls it had seen by then, this one included
    assert [h["recorded_calls"] for h in checks["history"]] == [6, 12, 18]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S[2] * timeout_scale() + 60)
def test_a_participant_sees_every_point_of_every_step_on_each_pipeline_stage(tmp_path):
    checks = session(2, "two_stages", tmp_path)["two_stages"]["checks"]
    assert checks["ranks"] == [expected_calls(), expected_calls()]
    assert [h["recorded_calls"] for h in checks["history"]] == [6, 12, 18]
