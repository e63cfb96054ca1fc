"""The launcher and the scripts around it: which rank it blames, its one-line endings,
workers that die with it, run_train.sh's checks and --help, and the Slurm script's
argument forwarding (with stand-in `srun`/`scontrol` that record what they are given)."""

from __future__ import annotations

import signal
import time

import pytest

from tests.helpers.live_run import LiveRun, running
from tests.helpers.commands import assert_one_line_user_error, marked_processes, run_command

SHORT = ["--config", "debug_model", "--training.steps", "200", "--training.seq_len", "64",
         "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]


@pytest.mark.timeout(400)
def test_workers_die_with_a_killed_launcher(tmp_path):
    """kill -9 of the launcher: no worker trains on unsupervised."""
    live = LiveRun(2, [*SHORT, "--job.dump_folder", str(tmp_path)])
    live.wait_for(r"step +1 +loss", 300)
    workers = [live.worker_pid(0), live.worker_pid(1)]
    live.signal_launcher(signal.SIGKILL)
    deadline = time.monotonic() + 15
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = [pid for pid in workers if running(pid)]
    if orphans:
        live.abort(f"workers {orphans} outlived their launcher by 15 s")
    live.finish(30)
    assert not marked_processes(live.marker)


@pytest.mark.timeout(400)
def test_ctrl_c_ends_the_run_with_one_line(tmp_path):
    """SIGINT to the launcher (Ctrl-C): every process ends, one line, no traceback."""
    live = LiveRun(2, [*SHORT, "--job.dump_folder", str(tmp_path)])
    live.wait_for(r"step +1 +loss", 300)
    live.signal_launcher(signal.SIGINT)
    run = live.finish(60)
    assert run.returncode == 128 + signal.SIGINT, run.describe()
    lines = [line for line in run.stdout.splitlines() if line.startswith("titanlite:")]
    assert lines == ["titanlite: stopped by SIGINT; the workers were stopped without a checkpoint (SIGTERM or SIGUSR1 saves one first)"], run.describe()
    assert "Traceback" not in run.stdout, run.describe()
