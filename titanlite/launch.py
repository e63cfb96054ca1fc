"""`python -m titanlite.launch [torchrun args] -m titanlite.train ...`: torchrun, with one-line failures.

This is torchrun itself (`torch.distributed.run`): same flags, same c10d rendezvous,
same elastic agent. Two additions: CPU thread settings for the workers, and how a failed
run ends.

On a host without GPUs the workers share its cores, so unless the caller set them:
OMP_NUM_THREADS = cores / processes (torchrun's own default is 1 thread per process), and
OMP_WAIT_POLICY = PASSIVE: torch's CPU wheels run intra-op parallelism on GNU OpenMP
(libgomp, which MKL follows), whose idle threads otherwise spin after every parallel
region and starve whatever else needs the cores (another rank, gloo's threads, the data
prefetcher); docs/performance.md has the measurements. libgomp reads both once, at start,
so they must be in the workers' environment.

A rank that exits with the user-error code has already printed its one line, so the
launcher exits with that code quietly instead of adding torchrun's report of every rank;
any other failure gets a short summary line and keeps its exit code. The elastic agent's own per-rank failure records
("failed (exitcode: ...)", "Sending process ... closing signal") are dropped for the same
reason: the rank's output and that line already say it.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from titanlite.errors import USER_ERROR_EXIT_CODE
from titanlite.parallel.distributed import usable_cores


class _DropFailureRecords(logging.Filter):
    """Drop the agent's records about children that failed or were stopped after a failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("failed (exitcode") or "closing signal" in text)


def set_cpu_thread_defaults(nproc_per_node: str) -> None:
    """Thread settings for CPU workers (see the module docstring); values the caller set are kept."""
    if torch.cuda.is_available():
        return
    if nproc_per_node.isdigit():
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // int(nproc_per_node))))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    set_cpu_thread_defaults(str(args.nproc_per_node))
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropFailureRecords())
    try:
        run(args)
    except ChildFailedError as error:
        failures = error.failures
        codes = {failure.exitcode for failure in failures.values()}
        if USER_ERROR_EXIT_CODE in codes:
            return USER_ERROR_EXIT_CODE
        rank, first = min(failures.items())
        cause = f"signal {first.signal_name()}" if first.exitcode < 0 else f"exit code {first.exitcode}"
        print(f"titanlite: rank {rank} failed ({cause}); see its output above", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
