"""Run-time faults, as real gloo runs through the launcher: a rank killed (with and without
a restart), a rank stopped, SIGTERM to the launcher, a non-finite loss; the kill and SIGTERM
also in a pipeline (pp 2, whose stages wait for each other in sends and receives rather than
collectives), the stop and a rank stuck in its own code in pipelines with FSDP or expert
parallelism (pp 2 x 2), and the non-finite loss there (computed on the last stage's rank). Each run is the
debug model at seq_len 64; every wait has a hard timeout, and every process a run starts
must be gone when it ends (tests/helpers/live_run.py).

The exact-resume tests compare TensorBoard's float32 losses with one uninterrupted run of
the same config (the `reference` fixture).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.distributed import REPO, read_tensorboard, run_env, with_overrides
from tests.helpers.live_run import LiveRun, running

STEPS = 12
TIMEOUT_S = 10  # comm.train_timeout_seconds of these runs
START_S = 240  # start-up and the first steps, on 2 cores shared with other suites
RUN_S = 420
ARGS = [
    "--config",
    "debug_model",
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--comm.train_timeout_seconds",
    str(TIMEOUT_S),
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.interval",
    "2",
    "--checkpoint.async_mode",
    "async",
    "--metrics.peak_flops",
    "1e11",  # no start-up matmul measurement
]
COMMIT_LINE = re.compile(r"checkpoint: step (\d+) committed")


def args(dump_folder: Path, *extra: str) -> list[str]:
    return with_overrides(ARGS, ["--job.dump_folder", str(dump_folder)], extra)


def losses(dump_folder: Path) -> dict[int, float]:
    """step -> loss of the newest TensorBoard run under the folder (float32, as stored)."""
    return dict(read_tensorboard(dump_folder / "tb")["loss"])


def committed_steps(dump_folder: Path) -> list[int]:
    return sorted(
        int(p.parent.name.removeprefix("step-")) for p in (dump_folder / "checkpoint").glob("step-*/commit.json")
    )


def titanlite_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("titanlite:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The losses of one uninterrupted run of ARGS."""
    folder = tmp_path_factory.mktemp("reference")
    run = LiveRun(2, args(folder)).finish(START_S + RUN_S)
    assert run.returncode == 0, run.describe()
    return losses(folder)


@pytest.mark.timeout(3 * START_S + 2 * RUN_S)
def test_killed_rank_restarts_and_resumes_to_the_same_loss(tmp_path, reference):
    """kill -9 of rank 1 with MAX_RESTARTS 1: the job restarts by itself, resumes from the
    newest complete checkpoint and ends with the uninterrupted run's loss."""
    live = LiveRun(2, args(tmp_path), launcher_args=("--max-restarts", "1"))
    live.wait_for(r"step +5 +loss", START_S)
    os.kill(live.worker_pid(1), signal.SIGKILL)
    run = live.finish(START_S + RUN_S)
    assert run.returncode == 0, run.describe()
    assert "titanlite: rank 1 was killed by signal SIGKILL; restarting the job (1 of 1 restarts)" in run.stdout, (
        run.describe()
    )
    before, _, after = run.stdout.partition("resumed at step ")
    assert after, f"the restarted job did not resume\n{run.describe()}"
    resumed = int(after.split()[0])
    assert resumed == max(int(s) for s in COMMIT_LINE.findall(before)), (
        f"not the newest complete checkpoint\n{run.describe()}"
    )
    final = losses(tmp_path)[STEPS]
    assert final == reference[STEPS], f"final loss {final} vs uninterrupted {reference[STEPS]}\n{run.describe()}"
    assert "Traceback" not in run.stdout, run.describe()


PIPELINE = ("--parallelism.pipeline_parallel_degree", "2")


@pytest.mark.timeout(START_S + RUN_S)
@pytest.mark.parametrize("layout", [(), PIPELINE], ids=["fsdp2", "pp2"])
def test_killed_rank_without_restarts_ends_every_process(tmp_path, layout):
    """kill -9 of rank 1, no restart: every process is gone within the collective timeout
    + 30 s, and the launcher names rank 1 and exits non-zero. Rank 0 (whose collective lost
    its peer) is stopped by the launcher and leaves the telling to it."""
    live = LiveRun(2, args(tmp_path, *layout))
    live.wait_for(r"step +2 +loss", START_S)
    os.kill(live.worker_pid(1), signal.SIGKILL)
    killed_at = time.monotonic()
    run = live.finish(TIMEOUT_S + 30)
    assert run.returncode != 0, run.describe()
    assert time.monotonic() - killed_at <= TIMEOUT_S + 30, run.describe()
    lines = titanlite_lines(run.stdout)
    assert len(lines) == 1 and lines[0].startswith("titanlite: rank 1 failed first (killed by signal SIGKILL)"), (
        run.describe()
    )
    assert "Traceback" not in run.stdout, run.describe()


@pytest.mark.timeout(2 * START_S + RUN_S)
def test_stopped_rank_times_out_on_every_other_rank(tmp_path):
    """SIGSTOP of rank 1 in a dp 2 x tp 2 run: ranks 0, 2 and 3 (which wait for it in tp and
    dp collectives) each exit within the timeout + 30 s, and the job ends with exit code 3
    and exactly one line: the launcher's, naming rank 1 (found stopped) and the collective
    that timed out waiting for it."""
    live = LiveRun(
        4,
        args(
            tmp_path,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--checkpoint.enable_checkpoint",
            "false",
            "--metrics.enable_tensorboard",
            "false",
        ),
    )
    live.wait_for(r"step +2 +loss", 2 * START_S)
    others = {rank: live.worker_pid(rank) for rank in (0, 2, 3)}
    stopped = live.worker_pid(1)
    os.kill(stopped, signal.SIGSTOP)
    stopped_at = time.monotonic()
    while any(running(pid) for pid in others.values()) and time.monotonic() - stopped_at < TIMEOUT_S + 30:
        time.sleep(0.5)
    alive = [rank for rank, pid in others.items() if running(pid)]
    if alive:
        live.abort(f"ranks {alive} still running {TIMEOUT_S + 30} s after rank 1 stopped")
    run = live.finish(RUN_S)
    assert run.returncode == 3, run.describe()
    lines = titanlite_lines(run.stdout)
    assert len(lines) == 1 and lines[0].startswith(
        "titanlite: rank 1 stopped responding (its process was stopped); rank "
    ), run.describe()
    assert f"timed out after {TIMEOUT_S} s" in lines[0], run.describe()
    assert "Traceback" not in run.stdout, run.describe()


MOE_EP2 = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "2")


@pytest.mark.timeout(2 * START_S + RUN_S)
@pytest.mark.parametrize(
    "layout, rank, fault",
    [((), 1, "stop"), (MOE_EP2, 2, "stop"), ((), 2, "spin")],
    ids=["fsdp2-stopped", "ep2-stopped", "fsdp2-spinning"],
)
def test_an_unresponsive_pipeline_rank_is_named_and_the_job_ends(tmp_path, layout, rank, fault):
    """pp 2 x FSDP 2 and pp 2 x ep 2 (a Qwen3 MoE), 4 ranks: one rank stopped (SIGSTOP) after
    step 3, or stuck in its own code at step 4 (a busy loop, tests/helpers/hang_worker.py). Its
    peers time out in all-gathers, all-to-alls or pipeline sends and receives (which the stage
    wraps in its own "[Stage 0] failed to run forward" error); the launcher kills the rank and
    ends the job within the timeout and a few seconds (not torchrun's 30 s wait for a SIGKILL),
    with exit code 3 and exactly one line naming that rank, not the one that timed out first."""
    hang = {"TITANLITE_TEST_HANG": f"{rank}:4:{fault}"} if fault != "stop" else {}
    live = LiveRun(
        4,
        args(
            tmp_path,
            *PIPELINE,
            *layout,
            "--checkpoint.enable_checkpoint",
            "false",
            "--metrics.enable_tensorboard",
            "false",
        ),
        env=hang,
        module="tests.helpers.hang_worker" if hang else "titanlite.train",
    )
    live.wait_for(r"step +3 +loss", 2 * START_S)
    if fault == "stop":
        os.kill(live.worker_pid(rank), signal.SIGSTOP)
    since = time.monotonic()
    run = live.finish(TIMEOUT_S + 60)
    assert time.monotonic() - since < TIMEOUT_S + 15, (
        f"the job ended {time.monotonic() - since:.0f} s after the {fault}\n{run.describe()}"
    )
    assert run.returncode == 3, run.describe()
    lines = titanlite_lines(run.stdout)
    why = "its process was stopped" if fault == "stop" else "stuck for "
    assert len(lines) == 1 and lines[0].startswith(f"titanlite: rank {rank} stopped responding ({why}"), run.describe()
    assert f"timed out after {TIMEOUT_S} s" in lines[0], run.describe()
    assert fault == "stop" or "in hang, tests/helpers/hang_worker.py:" in lines[0], run.describe()
    assert "Traceback" not in run.stdout, run.describe()


@pytest.mark.timeout(2 * START_S + RUN_S)
def test_sigterm_to_a_pipeline_saves_the_step_in_progress_and_resumes_there(tmp_path):
    """SIGTERM to the launcher of a pp 2 run: both stages finish their step, save it, exit 0
    with the one line; the next start resumes at that step (exactness of pipeline resumes:
    tests/runs/test_pipeline_context_resume.py)."""
    live = LiveRun(2, args(tmp_path, *PIPELINE))
    live.wait_for(r"step +3 +loss", START_S)
    live.signal_launcher(signal.SIGTERM)
    run = live.finish(RUN_S)
    assert run.returncode == 0, run.describe()
    match = re.search(
        r"^titanlite: stopped by SIGTERM after step (\d+); checkpoint saved to (\S+)$", run.stdout, re.MULTILINE
    )
    assert match and committed_steps(tmp_path)[-1] == int(match.group(1)) < STEPS, run.describe()
    resumed = LiveRun(2, args(tmp_path, *PIPELINE, "--training.steps", str(int(match.group(1)) + 1))).finish(
        START_S + RUN_S
    )
    assert resumed.returncode == 0 and f"resumed at step {match.group(1)}" in resumed.stdout, resumed.describe()


@pytest.mark.timeout(3 * START_S + 2 * RUN_S)
def test_sigterm_to_launcher_saves_the_step_in_progress_and_resumes(tmp_path, reference):
    """SIGTERM to the launcher: the ranks finish their step, save it, exit 0 with one line
    saying where; the next start resumes there and trains on as an uninterrupted run."""
    live = LiveRun(2, args(tmp_path))
    live.wait_for(r"step +3 +loss", START_S)
    live.signal_launcher(signal.SIGTERM)
    run = live.finish(RUN_S)
    assert run.returncode == 0, run.describe()
    match = re.search(
        r"^titanlite: stopped by SIGTERM after step (\d+); checkpoint saved to (\S+)$", run.stdout, re.MULTILINE
    )
    assert match, run.describe()
    step, path = int(match.group(1)), Path(match.group(2))
    assert step < STEPS and path == tmp_path / "checkpoint" / f"step-{step}", run.describe()
    assert committed_steps(tmp_path)[-1] == step, run.describe()
    assert titanlite_lines(run.stdout) == [match.group(0)], run.describe()

    resumed = LiveRun(2, args(tmp_path)).finish(START_S + RUN_S)
    assert resumed.returncode == 0, resumed.describe()
    assert f"resumed at step {step}" in resumed.stdout, resumed.describe()
    after = losses(tmp_path)
    assert sorted(after) == list(range(step + 1, STEPS + 1)), resumed.describe()
    assert all(after[s] == reference[s] for s in after), f"{after} vs {reference}"


@pytest.mark.timeout(2 * START_S + 2 * RUN_S)
def test_non_finite_loss_stops_before_saving_it_or_is_skipped(tmp_path):
    """A NaN injected into the loss at step 5 stops both ranks with the step number; the
    newest checkpoint is step 4. With training.max_nan_skips 1 the same run goes on past it.
    In a pipeline (pp 2): the loss is on rank 1's last stage, the agreement carries it to
    rank 0, which holds no loss (the same path as an FSDP rank whose own loss is finite)."""
    nan_at_5 = {"TITANLITE_FAULT_NAN_AT_STEP": "5"}
    short = ["--training.steps", "6", *PIPELINE]
    run = LiveRun(2, args(tmp_path, *short), env=nan_at_5).finish(START_S + RUN_S)
    assert run.returncode == 2, run.describe()
    assert titanlite_lines(run.stdout) == [
        next(line for line in run.stdout.splitlines() if line.startswith("titanlite: error: step 5: non-finite loss"))
    ], run.describe()
    assert committed_steps(tmp_path) == [2, 4], run.describe()
    assert "Traceback" not in run.stdout, run.describe()

    skipped = LiveRun(2, args(tmp_path, *short, "--training.max_nan_skips", "1"), env=nan_at_5).finish(START_S + RUN_S)
    assert skipped.returncode == 0, skipped.describe()
    assert re.search(
        r"step 5: non-finite loss .*optimizer step skipped \(1 of training.max_nan_skips 1\)", skipped.stdout
    ), skipped.describe()
    scalars = read_tensorboard(tmp_path / "tb")
    assert scalars["skipped_steps"] == [(5, 1.0)], scalars.get("skipped_steps")
    assert committed_steps(tmp_path)[-1] == 6, skipped.describe()


def test_every_process_group_takes_the_train_timeout(tmp_path):
    """The default group, a mesh's groups and the checkpoint group all move from the start-up
    timeout to the training one (one process of a world of one: real gloo groups)."""
    script = (
        "from titanlite.parallel import distributed as d\n"
        "import torch.distributed as dist\n"
        "d.init_distributed(300)\n"
        "g = d.new_group(backend='gloo', group_desc='checkpoint')\n"
        "other = dist.new_group(backend='gloo')\n"
        "d.adopt_groups([other])\n"
        "read = lambda pg: pg._get_backend(__import__('torch').device('cpu')).options._timeout.total_seconds()\n"
        "print([read(pg) for pg in (dist.group.WORLD, g, other)])\n"
        "d.set_collective_timeout(7)\n"
        "print([read(pg) for pg in (dist.group.WORLD, g, other)])\n"
        "d.shutdown()\n"
    )
    env = {k: v for k, v in run_env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[300.0, 300.0, 300.0]", "[7.0, 7.0, 7.0]"], result.stdout
