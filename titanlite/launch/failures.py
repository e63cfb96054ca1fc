"""The launcher's one line for a failed job, and for a restart: which rank failed first, and how.

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
  (runtime/stuck.py) when it closed the workers (`supervise.py` records them here), and
  killed, with the line of the collective that timed out waiting for it.
- A restart (`--max-restarts`) is said in one line too, unless it cannot help: a user error
  would only meet the same input again.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from titanlite.errors import COLLECTIVE_FAILURE_EXIT_CODE, USER_ERROR_EXIT_CODE
from titanlite.runtime.stuck import Stuck

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

# The global ranks of workers found stopped when the agent closed them: the ranks that
# stopped responding (killed by the launcher, they are the cause, not a failure of their own).
STOPPED_WORKER_RANKS: list[int] = []
# Workers found stuck in their own code when the agent closed them (runtime/stuck.py), by
# global rank: killed and named like the stopped ones.
STUCK_WORKERS: dict[int, Stuck] = {}


def restart_line(failures: dict[int, ProcessFailure], attempt: int, restarts: int) -> str:
    """The line a restart gets: which rank failed first and how, and that the job resumes
    from its newest complete checkpoint (the restarted trainer says the step)."""
    how = "the worker group became unhealthy"
    if failures:
        rank, first = first_failure(failures)
        how = f"rank {rank} failed (exit code {first.exitcode})"
        if first.exitcode < 0:
            how = f"rank {rank} was killed by signal {first.signal_name()}"
    return (
        f"titanlite: {how}; restarting the job ({attempt} of {restarts} restarts): it resumes from its newest "
        "complete checkpoint"
    )


def restart_can_help(failures: dict[int, ProcessFailure]) -> bool:
    """False when the rank that failed first made a user error (exit code 2: a bad config value
    found after the workers started): the restarted job would meet the same input and fail the
    same way, so the job ends at once with that error's line instead of restarting N times."""
    return not failures or first_failure(failures)[1].exitcode != USER_ERROR_EXIT_CODE


def first_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(global rank, failure) of the rank that failed first (see module doc)."""
    # min() keeps the first of equal keys: the order the agent saw them breaks a tie
    return min(failures.items(), key=lambda item: (consequence(item[1]), item[1].timestamp))


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
    waiting (a rank's own, as it handed it over; before the line of a rank that met its
    connection closed, once the launcher killed the stopped rank before that rank's own timeout)."""
    said = [line for _, f in sorted(failures.items()) if (line := _said(f))]
    timed_out = next((line for line in said if " timed out after " in line), said[0] if said else None)
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
