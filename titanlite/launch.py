"""`python -m titanlite.launch [torchrun args] -m titanlite.train ...`: torchrun, with one-line failures.

This is torchrun itself (`torch.distributed.run`): same flags, same c10d rendezvous,
same elastic agent. The only addition is how a failed run ends. A rank that exits with
the user-error code has already printed its one line, so the launcher exits with that code
quietly instead of adding torchrun's report of every rank; any other failure gets a short
summary line and keeps its exit code. The elastic agent's own per-rank failure records
("failed (exitcode: ...)", "Sending process ... closing signal") are dropped for the same
reason: the rank's output and that line already say it.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from titanlite.errors import USER_ERROR_EXIT_CODE


class _DropFailureRecords(logging.Filter):
    """Drop the agent's records about children that failed or were stopped after a failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("failed (exitcode") or "closing signal" in text)


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
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
