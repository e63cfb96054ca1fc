"""`python -m titanlite.config` as a command: a user error in one line with exit code 2, the
resolved config and the help printed (loading and validation on one process: tests/unit/test_load.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.distributed import REPO


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "titanlite.config", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_module_reports_a_user_error_in_one_line_with_exit_code_2():
    result = run_module("--training.steps", "ten")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["titanlite: error: training.steps: expected an integer, got 'ten'"]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_module_prints_the_resolved_config_and_help():
    result = run_module("--config", "debug_model", "--training.steps", "3")
    assert result.returncode == 0, result.stderr
    assert "[training]" in result.stdout and "steps = 3" in result.stdout
    result = run_module("--help")
    assert result.returncode == 0 and "--comm.train_timeout_seconds" in result.stdout
