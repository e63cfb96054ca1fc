"""The one exception type for mistakes a user can make, and the idioms that produce it.

Anything the user controls (config values, paths, mesh sizes, tokenizer files, checkpoints)
raises `TitanliteError` with a message that names the field or file and what is wrong.
The entry point turns it into a single line on rank 0 and exit code 2; every other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator


class TitanliteError(Exception):
    """A problem with the user's input, reported as one line and exit code 2."""


USER_ERROR_EXIT_CODE = 2
# A rank whose collective timed out or lost its peer: it printed its one line, and the
# rank that failed first is another (the launcher names that one).
COLLECTIVE_FAILURE_EXIT_CODE = 3
# Stopped by Ctrl-C (128 + SIGINT, the shell's convention).
INTERRUPTED_EXIT_CODE = 130
# How long a rank other than 0 waits before exiting on an error that every rank meets, so
# that rank 0's line is out before the launcher stops everyone (without titanlite's launcher).
RANK0_REPORT_GRACE_S = 3.0
# Set by `titanlite.launch` in its workers' environment (the pid whose death they follow,
# runtime/preemption.py): under it a worker hands its ending line to the launcher.
LAUNCHER_PID_ENV = "TITANLITE_LAUNCHER_PID"
# Where torchelastic's agent reads a worker's failure from (ProcessFailure.message), per worker.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are TitanliteErrors: one line and exit code 2 through the
    command's own error report, like config errors, not argparse's usage block."""

    def error(self, message: str) -> None:
        raise TitanliteError(message)


def say(line: str) -> None:
    """One line on stderr in one write. Every rank shares the launcher's stderr, and with
    PYTHONUNBUFFERED set (common in job scripts) `print` writes the text and its newline as
    two writes, so lines printed by two ranks at once could interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def hand_to_launcher(line: str) -> bool:
    """Under `titanlite.launch`, leave this rank's ending line in the file torchelastic's agent
    reads its failure from, and print nothing: the launcher prints one line for the whole job,
    the first cause's, whichever rank met it (a rank held back, or killed before it could
    print, cannot silence it). False, and nothing written, under another launcher or none."""
    path = os.environ.get(ERROR_FILE_ENV) if os.environ.get(LAUNCHER_PID_ENV) else None
    if not path:
        return False
    partial = f"{path}.partial-{os.getpid()}"
    with open(partial, "w") as f:
        json.dump({"message": line, "timestamp": int(time.time())}, f)
    os.replace(partial, path)  # the agent never reads half a file
    return True


def report_user_error(error: TitanliteError) -> int:
    """The error's one line; the exit code says it was the input.

    Under `titanlite.launch` every rank hands its line to the launcher, which prints it once
    (`hand_to_launcher`). Otherwise rank 0 prints and the others stay quiet: validation is
    deterministic and checkpoint problems are decided on rank 0 and broadcast, so rank 0
    meets what they meet; they wait a moment before exiting, since torchrun stops all
    processes as soon as one fails, which could kill rank 0 before its line is out. The rank
    is read from torchrun's environment, as `world_from_env` does, because this also runs
    before torch is imported (a config that does not load).
    """
    line = f"titanlite: error: {error}"
    if hand_to_launcher(line):
        return USER_ERROR_EXIT_CODE
    if int(os.environ.get("RANK", 0)) == 0:
        say(line)
    else:
        time.sleep(RANK0_REPORT_GRACE_S)
    return USER_ERROR_EXIT_CODE


def say_notices(notices: list[str]) -> None:
    """Notes about the input that change nothing (another tool's options that are off), once:
    on rank 0, read from torchrun's environment like `report_user_error`."""
    if int(os.environ.get("RANK", 0)) == 0:
        for notice in notices:
            say(f"titanlite: note: {notice}")


def one_line(error: BaseException) -> str:
    """The root cause of an exception as `Type: first non-empty line`.

    DCP wraps per-rank failures in a CheckpointException whose `failures` maps rank ->
    (exception, traceback); the first failing rank's cause is what a user needs to read.
    """
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _trace) = sorted(failures.items())[0]
        return f"rank {rank}: {one_line(inner)}"
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


@contextlib.contextmanager
def user_errors(what: str, keep: Callable[[BaseException], object] | None = None) -> Iterator[None]:
    """Turn any failure inside the block into `TitanliteError("<what>: <cause>")`.

    For calls into libraries that fail on bad input with their own exception types (DCP
    raises CheckpointException, a BaseException; datasets raises many). Ctrl-C, exits, our
    own errors and those `keep` returns a truthy value for pass through unchanged.
    """
    try:
        yield
    except (TitanliteError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:
        if keep is not None and keep(error):
            raise
        raise TitanliteError(f"{what}: {one_line(error)}") from None
