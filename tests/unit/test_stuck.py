"""runtime/stuck.py: a worker's record of its main thread stuck in its own code, as the launcher
reads it. Each case is one real process (a world of one, collective timeout 2 s, so a record
after 1 s) whose main thread hangs in tests/helpers/hang_worker.py; the test reads the record
from outside, as the launcher does, then kills the process."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from tests.helpers.distributed import REPO, run_env
from titanlite.errors import ERROR_FILE_ENV, LAUNCHER_PID_ENV
from titanlite.runtime.stuck import read_stuck, watch_main_thread

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
