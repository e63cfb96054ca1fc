"""What the launcher changes in torchrun's agent before it starts the workers (`supervise`).

- SIGTERM and SIGUSR1 are forwarded to the workers, which finish their step, save a
  checkpoint and exit 0 (titanlite/runtime/preemption.py); the launcher keeps supervising them, so
  its exit code is theirs. torchrun's own handling would give them 30 s before SIGKILL,
  which a large checkpoint can outlast. A second one stops them the way torchrun does.
- Ctrl-C (SIGINT), SIGHUP and SIGQUIT: torchrun stops the workers at once; one line.
- The workers die with the launcher: `LAUNCHER_PID_ENV` tells them whose death to follow.
- A worker found stopped or stuck when the agent closes the workers is killed at once and
  recorded (`failures.STOPPED_WORKER_RANKS`, `failures.STUCK_WORKERS`) for the one line to name.
- A restart is said in one line (`failures.restart_line`); the agent's own per-rank records
  are dropped.
- Restarts (`--max-restarts`) get a fresh c10d store each: with the agent's shared store
  (torch's default since 2.5) a restarted worker reads the previous attempt's addresses
  for every group after the first and hangs connecting to them (seen on torch 2.13).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch.distributed.elastic.multiprocessing import SignalException

from titanlite.errors import ERROR_FILE_ENV, LAUNCHER_PID_ENV, say
from titanlite.launch.failures import STOPPED_WORKER_RANKS, STUCK_WORKERS, restart_can_help, restart_line
from titanlite.runtime.preemption import FORWARDED_SIGNALS
from titanlite.runtime.stuck import read_stuck

_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


def supervise(args: argparse.Namespace) -> None:
    """Everything above, set up before `torch.distributed.run.run(args)`."""
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).addFilter(_not_about_workers)
    _kill_unresponsive_workers_when_closing()
    _say_restarts()
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see module doc
    _take_stop_signals(args)


def _not_about_workers(record: logging.LogRecord) -> bool:
    """Drop the agent's records about failed or stopped children and its own shutdown: the
    ranks' own lines and the launcher's one line already say it."""
    marks = ("failed (exitcode", "closing signal", "death signal", "Unable to shutdown process")
    return not any(mark in str(record.msg) for mark in marks)


def _say_restarts() -> None:
    """The agent says a restart only in an INFO record, which its loggers (WARNING unless
    LOGLEVEL says otherwise) never create. Wraps the local agent's monitor: when it reports a
    failed group and restarts are left, the agent restarts it, and this says so first; unless a
    restart cannot help (`restart_can_help`): then no restarts are left and the agent ends the job."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitor_saying_restarts(self, worker_group):
        result = monitor(self, worker_group)
        failed = result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED)
        if failed and not restart_can_help(result.failures):
            self._remaining_restarts = 0
        if failed and self._remaining_restarts > 0:
            restarts = worker_group.spec.max_restarts
            say(restart_line(result.failures, restarts - self._remaining_restarts + 1, restarts))
            STOPPED_WORKER_RANKS.clear()  # the next attempt's workers are new processes
            STUCK_WORKERS.clear()
        return result

    _wrap_once(LocalElasticAgent, "_monitor_workers", monitor_saying_restarts)


def _kill_unresponsive_workers_when_closing() -> None:
    """torchrun ends the remaining workers with SIGTERM and waits 30 s before SIGKILL. A
    stopped worker (SIGSTOP, a debugger, a frozen cgroup) cannot take SIGTERM, nor can one
    stuck in its own code (runtime/stuck.py: SIGTERM only asks it for a checkpoint after its
    step), so the job outlived the collective timeout by those 30 s and ended on the SIGKILL
    (exit code 1). Such a worker is the rank the others waited for: it is killed at once and
    recorded, for the one line to name it. Every other worker gets SIGCONT first (in case it
    was stopped since), then torch's SIGTERM. Wraps torch's subprocess handler's close;
    everything else is torch's."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    close = handler.close

    def close_killing_unresponsive(self, death_sig=None) -> None:
        if _record_unresponsive(self.proc.pid):
            death_sig = signal.SIGKILL
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGCONT)
        close(self, death_sig)

    _wrap_once(handler, "close", close_killing_unresponsive)


def _wrap_once(owner: type, name: str, wrapper: Callable[..., Any]) -> None:
    """`owner.name = wrapper`, unless one of these wrappers is there already (a second
    `supervise` in one process, as in tests, keeps the first instead of wrapping it again)."""
    if not getattr(getattr(owner, name), "titanlite_wrapper", False):
        wrapper.titanlite_wrapper = True
        setattr(owner, name, wrapper)


def _record_unresponsive(pid: int) -> bool:
    """Whether the worker is stopped or stuck (and then recorded above); False if it is gone."""
    try:
        environ = _environ(pid)
        if _stat(pid)[:1] in (["T"], ["t"]):
            STOPPED_WORKER_RANKS.append(int(environ[b"RANK"]))
            return True
        stuck = read_stuck(os.fsdecode(environ[ERROR_FILE_ENV.encode()]))
        if stuck is not None:
            STUCK_WORKERS[int(environ[b"RANK"])] = stuck
        return stuck is not None
    except (OSError, KeyError):
        return False


def _stat(pid: int) -> list[str]:
    """A process's /proc stat fields after "pid (name)": its state ("T": stopped), its parent's
    pid, ...; [] when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()
    except OSError:
        return []


def _environ(pid: int) -> dict[bytes, bytes]:
    """The environment the agent started a worker with (RANK, its error file)."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        return dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)


def _worker_pids() -> list[int]:
    """This process's children: the workers (the agent starts each with Popen)."""
    me = str(os.getpid())
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _stat(int(entry))[1:2] == [me]]


class _Forwarder:
    """SIGTERM/SIGUSR1: pass the first on and keep supervising. Before any worker exists
    (the rendezvous), or at the second signal, stop the way torchrun would."""

    forwarded = False

    @classmethod
    def handle(cls, signum: int, frame: FrameType | None) -> None:
        workers = _worker_pids()
        if cls.forwarded or not workers:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        cls.forwarded = True
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def _take_stop_signals(args: argparse.Namespace) -> None:
    """Keep SIGTERM/SIGUSR1 out of the agent's hands (it would stop the workers) and
    forward them instead."""
    if hasattr(args, "signals_to_handle"):  # torch >= 2.9; before, the agent takes SIGTERM back at start
        names = [name.strip() for name in args.signals_to_handle.split(",")]
        args.signals_to_handle = ",".join(name for name in names if name not in ("SIGTERM", "SIGUSR1"))
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, _Forwarder.handle)


def signal_line(sig: signal.Signals) -> str:
    """The one line of a launcher stopped by a signal."""
    if sig in FORWARDED_SIGNALS and _Forwarder.forwarded:
        return f"titanlite: stopped by a second {sig.name}; the workers were stopped before they finished saving"
    if sig in FORWARDED_SIGNALS:
        return f"titanlite: stopped by {sig.name} before the workers started"
    return (
        f"titanlite: stopped by {sig.name}; the workers were stopped without a checkpoint (SIGTERM or SIGUSR1 "
        "saves one first)"
    )
