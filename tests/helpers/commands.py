"""Running titanlite's commands (the launcher, the trainer, the scripts) in a process with a
hard timeout and no leftovers, and reading what they print: shared by the tests under
tests/runs/ that start them. On a timeout, or when a worker outlives the launcher, the
processes the test started (found by a marker in their environment) are killed and the test fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.distributed import REPO, run_env, timeout_scale

RUN_TIMEOUT = 180  # seconds per command; generous, other suites may share the 2 cores
TEST_TIMEOUT = RUN_TIMEOUT + 60
MARKER_VAR = "TITANLITE_CLI_TEST_RUN"

# One per-step line, as titanlite/observe/metrics.py writes it (after the logger's timestamp).
STEP_LINE = re.compile(
    r"step +(?P<step>\d+)  loss +(?P<loss>\S+)  grad_norm +(?P<grad_norm>\S+)  lr (?P<lr>\S+)  "
    r"tps (?P<tps>[\d,]+)  mfu (?P<mfu>\S+)%  mem (?P<mem>\S+) GiB$"
)
# Anything that looks like a step line, well formed or not: counts lines from any rank.
ANY_STEP_LINE = re.compile(r"\bstep +\d+ +loss\b")

# What torchrun sets; a plain `python -m titanlite.train` must run without any of it.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------------------
# Running commands with a hard timeout and no leftovers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self) -> str:
        """The command, exit code and output tails, for assertion messages."""
        return (
            f"$ {' '.join(self.command)}\nexit code {self.returncode} after {self.seconds:.1f} s\n"
            f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-5000:]}"
        )


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment carries this run's marker (workers included:
    torchrun starts them in their own sessions, so a process group would miss them)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def kill_marked(marker: str) -> list[int]:
    """SIGKILL every process of this run (only ones this test started) and return their pids."""
    pids = marked_processes(marker)
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return pids


def run_command(command: list[str], env: dict[str, str], timeout: float = RUN_TIMEOUT) -> Run:
    """Run `command` from the repo root; fail the test on a hang (`timeout` x `timeout_scale()`)
    or on processes that outlive it."""
    timeout *= timeout_scale()
    marker = uuid.uuid4().hex
    env = {**env, MARKER_VAR: marker}
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = kill_marked(marker)
        process.kill()
        stdout, stderr = process.communicate()
        run = Run(command, process.returncode, stdout, stderr, time.monotonic() - start)
        pytest.fail(f"did not finish in {timeout} s (killed pids {killed}):\n{run.describe()}")
    run = Run(command, process.returncode, stdout, stderr, time.monotonic() - start)
    deadline = time.monotonic() + 10  # the launcher has returned; its workers must be gone too
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftovers = kill_marked(marker)
    assert not leftovers, f"processes still running after the command exited (killed {leftovers}):\n{run.describe()}"
    return run


def launch(nproc: int, argv: list[str]) -> Run:
    """`python -m titanlite.launch --standalone --nproc-per-node N -m titanlite.train ARGV`."""
    command = [
        sys.executable,
        "-m",
        "titanlite.launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "titanlite.train",
        *argv,
    ]
    return run_command(command, run_env())


def train_single_process(argv: list[str]) -> Run:
    """`python -m titanlite.train ARGV` on one plain process, with no torchrun variables set."""
    env = {k: v for k, v in run_env().items() if k not in LAUNCHER_ENV}
    return run_command([sys.executable, "-m", "titanlite.train", *argv], env)


# --------------------------------------------------------------------------------------
# Reading the output
# --------------------------------------------------------------------------------------


def step_lines(run: Run) -> list[re.Match]:
    """The per-step lines, each checked against the documented format."""
    lines = [line for line in run.output.splitlines() if ANY_STEP_LINE.search(line)]
    matches = []
    for line in lines:
        match = STEP_LINE.search(line)
        assert match, f"step line not in the documented format: {line!r}\n{run.describe()}"
        matches.append(match)
    return matches


def printed_tolerance(text: str) -> float:
    """Half a unit in the last printed digit: '8.7363' -> 5e-5, '1.6e-04' -> 5e-6, '1,234' -> 0.5."""
    mantissa, _, exponent = text.replace(",", "").lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def printed_value(text: str) -> float:
    return float(text.replace(",", ""))


def assert_one_line_user_error(run: Run, mentions: list[str]) -> None:
    """Exit code 2, one `titanlite: error:` line naming the problem, no traceback, no
    launcher failure summary on top."""
    assert run.returncode == 2, f"expected exit code 2\n{run.describe()}"
    error_lines = [line for line in run.output.splitlines() if "titanlite: error:" in line]
    assert len(error_lines) == 1, (
        f"expected exactly one 'titanlite: error:' line, got {len(error_lines)}\n{run.describe()}"
    )
    for text in mentions:
        assert text in error_lines[0], f"the error line does not name {text!r}: {error_lines[0]!r}"
    assert "Traceback" not in run.output, f"traceback in the output of a user error\n{run.describe()}"
    assert "titanlite: rank" not in run.output, f"launcher reported a crash for a user error\n{run.describe()}"
