"""A launcher run a test can watch and poke while it trains: read its output as it comes,
find a worker by rank, signal it or the launcher, and finish with no process left behind.

Every process of a run carries a marker in its environment (tests/helpers/commands.py), so
workers are found and, on any failure, killed, though torchrun starts them in their own sessions.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.commands import MARKER_VAR, Run, kill_marked, marked_processes
from tests.helpers.distributed import REPO, run_env


def running(pid: int) -> bool:
    """The process exists and has not exited (an exited child its parent has not reaped yet
    is a zombie: gone for every purpose but its /proc entry)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class LiveRun:
    """`python -m titanlite.launch --standalone --nproc-per-node N [launcher args] -m MODULE ARGV` (MODULE:
    titanlite.train unless given)."""

    def __init__(
        self,
        nproc: int,
        argv: list[str],
        launcher_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        module: str = "titanlite.train",
    ):
        self.marker = uuid.uuid4().hex
        self.command = [
            sys.executable,
            "-m",
            "titanlite.launch",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *launcher_args,
            "-m",
            module,
            *argv,
        ]
        self.started = time.monotonic()
        self.lines: list[str] = []
        self._changed = threading.Condition()
        full_env = {**run_env(), **(env or {}), MARKER_VAR: self.marker}
        self.process = subprocess.Popen(
            self.command, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first output line matching `pattern`, waiting for it; fails the test (and
        kills the run) if it does not come."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                match = next((m for m in map(regex.search, self.lines) if m), None)
                if match:
                    return match
                if time.monotonic() > deadline or (self.process.poll() is not None and not self._reader.is_alive()):
                    self.abort(f"no line matching {pattern!r}")
                self._changed.wait(timeout=1)

    def worker_pid(self, rank: int) -> int:
        """The pid of the training process of global rank `rank`."""
        for pid in marked_processes(self.marker):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and pid != self.process.pid:
                return pid
        self.abort(f"no worker of rank {rank}")

    def signal_launcher(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def finish(self, timeout: float) -> Run:
        """Wait for the launcher to exit; then every process of the run must be gone."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.abort(f"did not finish in {timeout} s")
        self._reader.join(timeout=10)
        run = self._run()
        deadline = time.monotonic() + 10
        while marked_processes(self.marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = kill_marked(self.marker)
        assert not leftovers, (
            f"processes still running after the launcher exited (killed {leftovers}):\n{run.describe()}"
        )
        return run

    def abort(self, why: str) -> None:
        killed = kill_marked(self.marker)
        self.process.kill()
        self._reader.join(timeout=10)
        pytest.fail(f"{why} (killed pids {killed}):\n{self._run().describe()}")

    def _run(self) -> Run:
        return Run(self.command, self.process.returncode, self.output, "", time.monotonic() - self.started)
