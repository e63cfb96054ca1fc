"""A torchft lighthouse and replica groups of the real trainer, as separate process trees, for
tests/runs/test_fault_tolerance.py: each group is its own world (own MASTER_PORT, ranks started
as torchrun starts its workers), so one group can be killed with SIGKILL and started again
while the others train on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import warm_start
from tests.helpers.distributed import REPO, free_port, run_env, timeout_scale
from titanlite.launch import set_cpu_worker_defaults

WORKER = Path(__file__).with_name("ft_worker.py")
LIGHTHOUSE = Path(sys.executable).with_name("torchft_lighthouse")
REFERENCE = Path(__file__).with_name("diloco_reference.py")


def run_python(argv: list[str], timeout: float) -> dict:
    """`python ARGV` as a world of one whose first argument is the JSON it writes; returns that JSON."""
    result = warm_start.run(argv, run_env(), timeout * timeout_scale())
    output = result.stdout[-2000:] + result.stderr[-4000:]
    assert result.returncode == 0, f"{argv[0]} exited {result.returncode}:\n{output}"
    return json.loads(Path(argv[1]).read_text())


@contextlib.contextmanager
def lighthouse(min_replicas: int, heartbeat_timeout_ms: int = 1000, join_timeout_ms: int = 1000) -> Iterator[str]:
    """A lighthouse on a free port for the duration; yields its address (TORCHFT_LIGHTHOUSE)."""
    port = free_port()
    process = subprocess.Popen(
        [
            str(LIGHTHOUSE),
            "--min_replicas",
            str(min_replicas),
            "--bind",
            f"[::]:{port}",
            "--heartbeat_timeout_ms",
            str(heartbeat_timeout_ms),
            "--join_timeout_ms",
            str(join_timeout_ms),
        ],
        env={**os.environ, "RUST_LOG": "warn"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)
        yield f"http://localhost:{port}"
    finally:
        process.kill()
        process.wait()


class Group:
    """One replica group: `nproc` ranks of tests/helpers/ft_worker.py, rank outputs in `folder`."""

    def __init__(self, replica: int, nproc: int, args: list[str], folder: Path, address: str, tag: str = "") -> None:
        self.replica, self.folder = replica, folder
        self.out = folder / f"replica_{replica}{tag}.json"
        self.logs = [folder / f"replica_{replica}{tag}_rank{rank}.log" for rank in range(nproc)]
        env = {**run_env(), "TORCHFT_LIGHTHOUSE": address}
        set_cpu_worker_defaults(str(2 * nproc), env)  # two groups share the host
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
        env["LOCAL_WORLD_SIZE"] = str(nproc)
        argv = [str(WORKER), str(self.out), *args, "--fault_tolerance.replica_id", str(replica)]
        self.processes = [
            warm_start.start(argv, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, str(REPO), str(log), str(log))
            for rank, log in enumerate(self.logs)
        ]

    def text(self) -> str:
        return "".join(log.read_text(errors="replace") for log in self.logs)

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.logs[0].read_text(errors="replace"), re.MULTILINE))

    def wait_for(self, pattern: str, timeout: float, seen: int = 0) -> re.Match:
        """Block until rank 0's output matches `pattern` (a regex) more than `seen` times; returns
        that match; fails the test past `timeout`."""
        deadline = time.monotonic() + timeout * timeout_scale()
        while time.monotonic() < deadline:
            found = list(re.finditer(pattern, self.logs[0].read_text(errors="replace"), re.MULTILINE))
            if len(found) > seen:
                return found[seen]
            if any(p.poll() not in (None, 0) for p in self.processes):
                break
            time.sleep(0.05)
        raise AssertionError(f"replica group {self.replica}: no {pattern!r} in its output:\n{self.text()[-4000:]}")

    def kill(self) -> float:
        """SIGKILL every rank; returns the time (monotonic) it was sent."""
        sent = time.monotonic()
        for process in self.processes:
            process.send_signal(signal.SIGKILL)
        for process in self.processes:
            process.wait()
        return sent

    def wait(self, timeout: float) -> dict:
        """The worker's JSON once every rank has exited 0; fails the test with the output otherwise."""
        deadline = time.monotonic() + timeout * timeout_scale()
        try:
            for process in self.processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"replica group {self.replica} did not finish:\n{self.text()[-4000:]}") from None
        codes = [p.returncode for p in self.processes]
        assert codes == [0] * len(codes), f"replica group {self.replica} exited {codes}:\n{self.text()[-4000:]}"
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
