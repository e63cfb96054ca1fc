"""`python -m titanlite.launch [torchrun args] -m titanlite.train ...`: torchrun, with one-line endings.

This is torchrun itself (`torch.distributed.run`): same flags, same c10d rendezvous, same
elastic agent and `--max-restarts`. It adds CPU thread and allocator settings for the workers and how a run ends.

On a host without GPUs the workers share its cores, so unless the caller set them:
OMP_NUM_THREADS = cores / processes (torchrun's own default is 1 thread per process),
OMP_WAIT_POLICY = PASSIVE and GOMP_SPINCOUNT = 1000: torch's CPU wheels run intra-op
parallelism on GNU OpenMP (libgomp, which MKL follows), whose idle threads by default spin
~3 ms after every parallel region and starve whatever else needs the cores (another rank,
gloo's threads, the data prefetcher), while never spinning (PASSIVE alone) puts every
thread to sleep between two kernels that follow each other within microseconds. A short
spin (1000 iterations, libgomp's GOMP_SPINCOUNT overrides the policy's count; other OpenMP
runtimes read only the policy) keeps both: docs/performance.md has the measurements.
libgomp reads these once, at start, so they must be in the workers' environment.
So does glibc's malloc, which by default serves every block over 32 MiB (and, past its
adaptive threshold, smaller ones) with a fresh mmap and returns it on free: a CPU training
step allocates and frees its activations, logits and gradients anew every step, and each
time the kernel maps and zeroes them again, page by page (55-63 thousand page faults per
debug-model step, ~5% of the step). A fixed MALLOC_MMAP_THRESHOLD_ of 32 MiB and
MALLOC_TRIM_THRESHOLD_ = 1 TiB keep every smaller freed block in the heap for the next step
(1-3 thousand faults), while blocks of 32 MiB and more (an FSDP unit's gathered weights, a
stack of experts' gradients) are mapped and given back: kept in the heap too (MALLOC_MMAP_MAX_
= 0, before issue 36), their holes, refilled by smaller blocks, made an MoE model's heap
outgrow one process's (docs/performance.md). glibc.malloc.hugetlb=1 (glibc >= 2.35; older
ones ignore it) maps those blocks with transparent huge pages where the kernel allows it
(madvise), one fault per 2 MiB instead of per 4 KiB.
`--cpu-bind` (opt-in) also binds each CPU worker to its own block of cores (runtime/cpu_binding.py).

How a run ends:

- A failure ends with exactly one line, the launcher's, and the first cause's exit code.
  Workers print no ending line of their own: each leaves it in the file torchelastic's
  agent reads its failure from (`errors.hand_to_launcher`), so a line reaches the user
  whichever rank met the error, even if rank 0 was held back or killed first. Ranks whose
  collective failed because of a peer (they exit with `COLLECTIVE_FAILURE_EXIT_CODE`) and
  ranks the agent stopped afterwards (SIGTERM) are consequences, not causes; among the
  others the first is the earliest by torchrun's timestamps (whole seconds), then by the
  order the agent saw them. A user error (exit 2) is printed as its rank wrote it. When
  every failure is a consequence, a rank stopped responding: the launcher names the one
  it found stopped (SIGSTOP, a debugger, a frozen cgroup) or stuck in its own code
  (runtime/stuck.py) when it closed the workers, and killed, with the line of the
  collective that timed out waiting for it. The agent's own per-rank
  records are dropped.
- SIGTERM and SIGUSR1 are forwarded to the workers, which finish their step, save a
  checkpoint and exit 0 (titanlite/runtime/preemption.py); the launcher keeps supervising them, so
  its exit code is theirs. torchrun's own handling would give them 30 s before SIGKILL,
  which a large checkpoint can outlast. A second one stops them the way torchrun does.
- Ctrl-C (SIGINT), SIGHUP and SIGQUIT: torchrun stops the workers at once; one line.
- The workers die with the launcher: `LAUNCHER_PID_ENV` tells them whose death to follow.
- Restarts (`--max-restarts`) get a fresh c10d store each: with the agent's shared store
  (torch's default since 2.5) a restarted worker reads the previous attempt's addresses
  for every group after the first and hangs connecting to them (seen on torch 2.13).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import MutableMapping
from types import FrameType

import torch
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import get_args_parser, run

from titanlite.runtime.cpu_binding import CPU_BIND_ENV, core_blocks, encode
from titanlite.errors import (
    COLLECTIVE_FAILURE_EXIT_CODE,
    ERROR_FILE_ENV,
    LAUNCHER_PID_ENV,
    USER_ERROR_EXIT_CODE,
    say,
)
from titanlite.parallel.distributed import usable_cores
from titanlite.runtime.preemption import FORWARDED_SIGNALS
from titanlite.runtime.stuck import Stuck, read_stuck

_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


class _DropAgentRecords(logging.Filter):
    """Drop the agent's records about failed or stopped children and its own shutdown: the
    ranks' own lines and the launcher's one line already say it."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not any(
            mark in text
            for mark in ("failed (exitcode", "closing signal", "death signal", "Unable to shutdown process")
        )


def restart_line(failures: dict[int, ProcessFailure], attempt: int, restarts: int) -> str:
    """The line a restart gets: which rank failed first and how, and that the job resumes
    from its newest complete checkpoint (the restarted trainer says the step)."""
    how = "the worker group became unhealthy"
    if failures:
        rank, first = first_failure(failures)
        how = f"rank {rank} " + (
            f"was killed by signal {first.signal_name()}"
            if first.exitcode < 0
            else f"failed (exit code {first.exitcode})"
        )
    return (
        f"titanlite: {how}; restarting the job ({attempt} of {restarts} restarts): it resumes from its newest "
        "complete checkpoint"
    )


def restart_can_help(failures: dict[int, ProcessFailure]) -> bool:
    """False when the rank that failed first made a user error (exit code 2: a bad config value
    found after the workers started): the restarted job would meet the same input and fail the
    same way, so the job ends at once with that error's line instead of restarting N times."""
    return not failures or first_failure(failures)[1].exitcode != USER_ERROR_EXIT_CODE


def _say_restarts() -> None:
    """The agent says a restart only in an INFO record, which its loggers (WARNING unless
    LOGLEVEL says otherwise) never create. Wraps the local agent's monitor: when it reports a
    failed group and restarts are left, the agent restarts it, and this says so first; unless a
    restart cannot help (`restart_can_help`): then no restarts are left and the agent ends the job."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers
    if getattr(monitor, "says_restarts", False):
        return

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

    monitor_saying_restarts.says_restarts = True
    LocalElasticAgent._monitor_workers = monitor_saying_restarts


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
    if getattr(handler.close, "kills_unresponsive", False):
        return
    close = handler.close

    def close_killing_unresponsive(self, death_sig=None) -> None:
        if _record_unresponsive(self.proc.pid):
            death_sig = signal.SIGKILL
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass
        close(self, death_sig)

    close_killing_unresponsive.kills_unresponsive = True
    handler.close = close_killing_unresponsive


# The global ranks of workers found stopped when the agent closed them: the ranks that
# stopped responding (killed by the launcher, they are the cause, not a failure of their own).
STOPPED_WORKER_RANKS: list[int] = []
# Workers found stuck in their own code when the agent closed them (runtime/stuck.py), by
# global rank: killed and named like the stopped ones.
STUCK_WORKERS: dict[int, Stuck] = {}


def _record_unresponsive(pid: int) -> bool:
    """Whether the worker is stopped or stuck (and then recorded above); False if it is gone."""
    try:
        environ = _environ(pid)
        if _process_state(pid) in ("T", "t"):
            STOPPED_WORKER_RANKS.append(int(environ[b"RANK"]))
            return True
        stuck = read_stuck(os.fsdecode(environ[ERROR_FILE_ENV.encode()]))
        if stuck is not None:
            STUCK_WORKERS[int(environ[b"RANK"])] = stuck
        return stuck is not None
    except (OSError, KeyError):
        return False


def _process_state(pid: int) -> str:
    """A process's state letter from /proc ("T": stopped), or "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _environ(pid: int) -> dict[bytes, bytes]:
    """The environment the agent started a worker with (RANK, its error file)."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        return dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)


def _args_problem(args) -> str | None:
    """What is wrong with the flags torchrun's parser accepts but fails on later."""
    nproc = str(args.nproc_per_node)
    if nproc not in _NPROC_WORDS and not (nproc.isdigit() and int(nproc) > 0):
        return (
            f"--nproc-per-node: expected a positive number of processes or one of {', '.join(_NPROC_WORDS)} (got "
            f"{nproc!r})"
        )
    if args.max_restarts < 0:
        return f"--max-restarts: expected 0 or more (got {args.max_restarts})"
    return None


def _worker_pids() -> list[int]:
    """This process's children: the workers (the agent starts each with Popen)."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
        except OSError:
            continue
        if int(fields[1]) == me:
            pids.append(int(entry))
    return pids


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
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def _take_stop_signals(args) -> None:
    """Keep SIGTERM/SIGUSR1 out of the agent's hands (it would stop the workers) and
    forward them instead."""
    if hasattr(args, "signals_to_handle"):  # torch >= 2.9; before, the agent takes SIGTERM back at start
        kept = [
            name.strip() for name in args.signals_to_handle.split(",") if name.strip() not in ("SIGTERM", "SIGUSR1")
        ]
        args.signals_to_handle = ",".join(kept)
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, _Forwarder.handle)


def first_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(global rank, failure) of the rank that failed first (see module doc)."""

    ordered = list(failures.items())
    index = min(range(len(ordered)), key=lambda i: (consequence(ordered[i][1]), ordered[i][1].timestamp, i))
    return ordered[index]


def _said(failure: ProcessFailure) -> str | None:
    """The ending line a worker handed over (`errors.hand_to_launcher`), if any."""
    message = failure.message
    return message if isinstance(message, str) and message.startswith("titanlite: ") else None


def _user_error(failures: dict[int, ProcessFailure]) -> str | None:
    """A user error's line that a rank handed over, whatever its exit: a rank still in Python's
    teardown after writing it may be stopped (SIGTERM) once a peer, which met it as a closed
    connection, has exited first."""
    said = (_said(failure) for _, failure in sorted(failures.items()))
    return next((line for line in said if line and line.startswith("titanlite: error: ")), None)


def consequence(failure: ProcessFailure) -> bool:
    """A rank that failed because another did: its collective found the peer gone or timed
    out (COLLECTIVE_FAILURE_EXIT_CODE), or the agent stopped it afterwards (SIGTERM)."""
    return failure.exitcode in (COLLECTIVE_FAILURE_EXIT_CODE, -signal.SIGTERM)


def failure_line(
    failures: dict[int, ProcessFailure],
    stopped_ranks: list[int] = STOPPED_WORKER_RANKS,
    stuck: dict[int, Stuck] = STUCK_WORKERS,
) -> tuple[str, int]:
    """The launcher's one line and its exit code."""
    killed = {*stopped_ranks, *stuck}  # by the launcher: the cause, not a failure of their own
    failures = {rank: failure for rank, failure in failures.items() if rank not in killed} or failures
    if user_error := _user_error(failures):
        return user_error, USER_ERROR_EXIT_CODE
    rank, first = first_failure(failures)
    if first.exitcode == USER_ERROR_EXIT_CODE and _said(first):
        return _said(first), USER_ERROR_EXIT_CODE
    if consequence(first):
        return _stopped_line(failures, stopped_ranks, stuck), COLLECTIVE_FAILURE_EXIT_CODE
    others = len(failures) - 1
    after = f"; {others} other rank(s) stopped after it" if others else ""
    if first.exitcode < 0:
        return f"titanlite: rank {rank} failed first (killed by signal {first.signal_name()}){after}", 1
    return (
        f"titanlite: rank {rank} failed first (exit code {first.exitcode}){after}; see its output above",
        first.exitcode,
    )


def _stopped_line(failures: dict[int, ProcessFailure], stopped_ranks: list[int], stuck: dict[int, Stuck]) -> str:
    """Every rank failed because of another: name the rank found stopped, or else the one
    stuck longest in its own code, if one was, with the line of a collective that timed out
    waiting (a rank's own, as it handed it over)."""
    timed_out = next((line for _, f in sorted(failures.items()) if (line := _said(f))), None)
    waited = f"; {timed_out.removeprefix('titanlite: ')}" if timed_out else ""
    if stopped_ranks:
        return f"titanlite: rank {min(stopped_ranks)} stopped responding (its process was stopped){waited}"
    if stuck:
        rank, longest = max(stuck.items(), key=lambda item: item[1].seconds)
        return (
            f"titanlite: rank {rank} stopped responding (stuck for {longest.seconds:.0f} s in {longest.where}, "
            f"outside any collective){waited}"
        )
    return (
        timed_out
        or f"titanlite: rank {min(failures)} failed (exit code {failures[min(failures)].exitcode}) waiting for "
        "another rank"
    )


def _signal_line(sig: signal.Signals) -> str:
    if sig in FORWARDED_SIGNALS and _Forwarder.forwarded:
        return f"titanlite: stopped by a second {sig.name}; the workers were stopped before they finished saving"
    if sig in FORWARDED_SIGNALS:
        return f"titanlite: stopped by {sig.name} before the workers started"
    return (
        f"titanlite: stopped by {sig.name}; the workers were stopped without a checkpoint (SIGTERM or SIGUSR1 "
        "saves one first)"
    )


# glibc malloc: blocks under 32 MiB reused from the heap, never given back; larger ones mapped
# and returned on free, on huge pages (see the module docstring).
CPU_MALLOC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def set_cpu_worker_defaults(nproc_per_node: str, env: MutableMapping[str, str] = os.environ) -> None:
    """Thread and allocator settings for CPU workers (see the module docstring) into `env`
    (this process's environment, which torchrun hands to the workers); values the caller
    set are kept."""
    if torch.cuda.is_available():
        return
    if nproc_per_node.isdigit():
        env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // int(nproc_per_node))))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("GOMP_SPINCOUNT", "1000")
    for name, value in CPU_MALLOC_DEFAULTS.items():
        env.setdefault(name, value)
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_TUNABLE}" if tunables else HUGE_PAGE_TUNABLE


def _parser():
    """torchrun's flags, plus titanlite's own."""
    parser = get_args_parser()
    parser.add_argument(
        "--cpu-bind",
        "--cpu_bind",
        action="store_true",
        help="CPU workers only: bind each local rank (and the threads it starts) to its own block of this "
        "host's usable cores (titanlite/runtime/cpu_binding.py)",
    )
    return parser


def set_cpu_binding(nproc_per_node: str) -> str | None:
    """`--cpu-bind`: the workers' core blocks into their environment; what is wrong, if anything."""
    if torch.cuda.is_available():
        return "--cpu-bind: for CPU workers only (this host has GPUs; see torchrun's --numa-binding)"
    if not nproc_per_node.isdigit():
        return f"--cpu-bind: needs --nproc-per-node as a number (got {nproc_per_node!r})"
    blocks = core_blocks(sorted(os.sched_getaffinity(0)), int(nproc_per_node))
    os.environ[CPU_BIND_ENV] = encode(blocks)
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    problem = _args_problem(args) or (set_cpu_binding(str(args.nproc_per_node)) if args.cpu_bind else None)
    if problem:
        print(f"titanlite: error: {problem}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_DropAgentRecords())
    _kill_unresponsive_workers_when_closing()
    _say_restarts()
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see module doc
    _take_stop_signals(args)
    set_cpu_worker_defaults(str(args.nproc_per_node))
    try:
        run(args)
    except ChildFailedError as error:
        line, code = failure_line(error.failures)
        print(line, file=sys.stderr)
        return code
    except SignalException as error:
        print(_signal_line(error.sigval), file=sys.stderr)
        return 128 + error.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
