"""Test processes started from a warm interpreter: a fork of one that has imported torch and
titanlite already.

Importing torch and titanlite costs every new process 5 to 8 s of CPU on two cores, more than
most test runs train; the suite starts hundreds of ranks. `start` gives each rank a fork of a
server process (multiprocessing's forkserver, one per test process) that did those imports
once: a real process with its own pid, environment, working directory, output files, gloo
sockets and exit code, that runs the script, `-m module` or `-c code` as `python` would, from
module state no test has touched. The launcher (torchrun) and the commands users type are
still tested as cold processes (tests/helpers/commands.py).

What a fork cannot redo, it sets the way a fresh process would: the OpenMP thread count
(`OMP_NUM_THREADS`, which libgomp reads at load) through `torch.set_num_threads`, sys.argv,
sys.path[0] and `__main__`; at the end, non-daemon threads are joined and atexit handlers run
before the process exits, as the interpreter does. The server itself starts with the
CPU-worker settings libgomp and glibc read once (titanlite.launch.set_cpu_worker_defaults).
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from titanlite.launch import set_cpu_worker_defaults

# What the ranks import: the trainer and its entry points (`-m titanlite.train` and friends).
PRELOAD = [
    "titanlite.trainer",
    "titanlite.train",
    "titanlite.plan",
    "titanlite.generate",
    "tests.helpers.session_worker",
    "torchft",  # the fault-tolerance workers'
]
REPO = Path(__file__).resolve().parents[2]


class WarmProcess:
    """The `subprocess.Popen` surface the tests use (pid, poll, wait, kill, returncode) over a
    forked rank."""

    def __init__(self, process: multiprocessing.process.BaseProcess, argv: list[str]) -> None:
        self._process, self.args, self.pid = process, argv, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return None if self._process.is_alive() else self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def send_signal(self, signal: int) -> None:
        os.kill(self.pid, signal)


_context: multiprocessing.context.BaseContext | None = None


def server() -> multiprocessing.context.BaseContext:
    """The warm forkserver's context, started on first use; torch.multiprocessing's
    "forkserver" start method forks from the same server once it runs."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        # libgomp's wait policy and glibc's malloc settings are read once, at load: the server
        # starts with a CPU worker's; the thread count each fork sets for itself (`_run`).
        set_cpu_worker_defaults("2")
        try:
            from multiprocessing.forkserver import ensure_running

            ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return _context


def start(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str, fresh: bool = False):
    """`python ARGV` (a script path, `-m module` or `-c code`, then its arguments) in `env` and
    `cwd`, its output appended to the files `stdout` and `stderr` (the same file for both is
    fine). `fresh`: a new interpreter instead, for what a fork would measure otherwise (a
    process's memory from its start)."""
    for path in {stdout, stderr}:
        open(path, "a").close()
    if fresh:
        with open(stdout, "a") as out, open(stderr, "a") as err:
            return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=out, stderr=err)
    process = server().Process(target=_run, args=(argv, env, cwd, stdout, stderr), daemon=False)
    process.start()
    return WarmProcess(process, [sys.executable, *argv])


def run(argv: list[str], env: dict[str, str], timeout: float, cwd: str = str(REPO)) -> subprocess.CompletedProcess:
    """`subprocess.run([python, *argv], capture_output=True, text=True)` in a warm process;
    past `timeout` it is killed and `subprocess.TimeoutExpired` carries its output so far."""
    with tempfile.TemporaryDirectory(prefix="warm-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        process = start(argv, env, cwd, str(out), str(err))
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise subprocess.TimeoutExpired(
                argv, timeout, out.read_text(errors="replace"), err.read_text(errors="replace")
            ) from None
        return subprocess.CompletedProcess(
            argv, process.returncode, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def _run(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True, errors="backslashreplace")
        for fd in (1, 2)
    )
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    code: int | str | None = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.modules.pop(argv[1], None)  # preloaded: run as __main__, as `python -m` does, not found imported
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    # As the interpreter's own exit does: threading's exit hooks (which shut down
    # concurrent.futures executors, Inductor's compile pool among them), then the join of every
    # non-daemon thread, then atexit. Joining first waited forever on an executor's idle workers.
    threading._shutdown()
    atexit._run_exitfuncs()
    raise SystemExit(code)
