"""titanlite/runtime/dump_folder.py's lock against another process: a job killed with -9
leaves its record, and the next run takes the lock over with a warning (the one-process
checks: tests/unit/test_dump_folder.py)."""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import signal
import socket
import subprocess
import sys

from tests.helpers.distributed import REPO
from tests.unit.test_dump_folder import message
from titanlite.runtime import dump_folder

HOLD = """
import sys, time
from pathlib import Path
from titanlite.runtime.dump_folder import acquire_lock
lock = acquire_lock(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def test_lock_of_a_killed_job_is_taken_over_with_a_warning(tmp_path):
    """A job killed with -9 leaves its record in the file; the kernel dropped its flock."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert f"pid {holder.pid}" in message(dump_folder.acquire_lock, tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    warnings = logging.handlers.BufferingHandler(capacity=100)
    titanlite_logger = logging.getLogger("titanlite")
    titanlite_logger.addHandler(warnings)  # direct: the logger may not propagate (init_logger)
    try:
        lock = dump_folder.acquire_lock(tmp_path)
    finally:
        titanlite_logger.removeHandler(warnings)
    text = " ".join(record.getMessage() for record in warnings.buffer)
    assert (
        f"taking over the lock {tmp_path / dump_folder.LOCK_FILE} of a run that ended without releasing it (host "
        f"{socket.gethostname()}, pid {holder.pid}" in text
    )
    assert json.loads((tmp_path / dump_folder.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
