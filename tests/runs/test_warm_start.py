"""tests/helpers/warm_start.py: a process forked from the warm server ends as `python` would."""

from __future__ import annotations

from tests.helpers import warm_start
from tests.helpers.distributed import run_env

# An executor left running (as Inductor's compile pool is), a non-daemon thread, an atexit hook.
EXITING = """
import atexit, concurrent.futures, sys, threading, time
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(time.sleep, 0.1)
atexit.register(lambda: print("atexit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread", flush=True))).start()
sys.exit(3)
"""


def test_a_fork_shuts_executors_down_joins_threads_runs_atexit_and_keeps_its_exit_code():
    """Joining every non-daemon thread before threading's exit hooks waited forever on an
    executor's idle workers: a session whose last case compiled (a cold Inductor cache) ran
    on to its hang guard, 900 s."""
    done = warm_start.run(["-c", EXITING], run_env(), timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == ["thread", "atexit"]
