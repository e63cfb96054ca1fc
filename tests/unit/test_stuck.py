"""runtime/stuck.py: a worker's record of its main thread stuck in its own code, as the launcher
reads it, and the launcher's line naming that rank. Each hang is one real process (a world of
one, collective timeout 2 s, so a record after 1 s) whose main thread hangs in
tests/helpers/hang_worker.py; the test reads the record from outside, as the launcher does,
then kills the process. The runs with 4 ranks: tests/runs/test_faults_runtime.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tests.helpers.distributed import REPO, run_env
from titanlite.errors import COLLECTIVE_FAILURE_EXIT_CODE, ERROR_FILE_ENV, LAUNCHER_PID_ENV, hand_to_launcher
from titanlite.launch.failures import failure_line
from titanlite.runtime.stuck import Stuck, read_stuck, watch_main_thread

SCRIPT = """
import sys
from titanlite.parallel import distributed
from titanlite.runtime.stuck import watch_main_thread
from tests.helpers.hang_worker import hang
distributed.init_distributed(300)
distributed.set_collective_timeout(2)
with watch_main_thread():
    hang(sys.argv[1])
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["spin", "deadlock"])
def test_a_hung_main_thread_leaves_a_record_naming_where(tmp_path, kind):
    error_file = str(tmp_path / "error.json")
    env = {k: v for k, v in run_env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({ERROR_FILE_ENV: error_file, LAUNCHER_PID_ENV: "1"})
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, kind], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 90
        while (stuck := read_stuck(error_file)) is None and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        process.kill()
        process.wait()
    assert stuck is not None, f"no record (exit code {process.returncode})"
    assert stuck.where.startswith("hang, tests/helpers/hang_worker.py:"), stuck
    assert 1 <= stuck.seconds < 10, stuck


def test_no_record_without_the_launcher(tmp_path, monkeypatch):
    """Outside `titanlite.launch` nothing is watched: no thread, no file."""
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "error.json"))
    before = threading.active_count()
    with watch_main_thread():
        assert threading.active_count() == before
    assert list(tmp_path.iterdir()) == []


def test_the_launcher_names_the_stuck_rank_it_killed(tmp_path, monkeypatch):
    """Rank 0's all-gather timed out (exit 3); rank 1, found stuck when the agent closed the
    workers, was killed by the launcher (SIGKILL): the cause, not a failure of its own; rank 2
    ended on the agent's SIGTERM. Without the record, rank 1's SIGKILL would be the first cause."""
    error_file, none = tmp_path / "error.json", str(tmp_path / "none.json")
    monkeypatch.setenv(LAUNCHER_PID_ENV, "1")
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    hand_to_launcher("titanlite: rank 0: an all-gather timed out after 10 s")
    failures = {
        0: ProcessFailure(0, 100, COLLECTIVE_FAILURE_EXIT_CODE, str(error_file)),
        1: ProcessFailure(1, 101, -signal.SIGKILL, none),
        2: ProcessFailure(2, 102, -signal.SIGTERM, none),
    }
    assert failure_line(failures, [], {1: Stuck(12.3, "hang, x.py:3")}) == (
        "titanlite: rank 1 stopped responding (stuck for 12 s in hang, x.py:3, outside any collective); rank 0: an "
        "all-gather timed out after 10 s",
        3,
    )
    assert failure_line(failures, [], {})[0].startswith("titanlite: rank 1 failed first (killed by signal SIGKILL)")
