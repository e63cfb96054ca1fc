"""How a worker process reacts to signals and to the death of its launcher.

- SIGTERM (a scheduler's preemption, or the launcher forwarding its own) and SIGUSR1
  (Slurm's warning before a time limit, `#SBATCH --signal=USR1@...`) only set a flag: the
  trainer finishes the step it is in, every rank agrees on the flag (it may reach only some
  ranks; the per-step agreement in `numerics.agree_on_step` carries it), writes a blocking
  checkpoint of that step and exits 0.
- SIGINT (Ctrl-C, forwarded by the launcher) stops at once, without a checkpoint; the
  trainer then exits quietly, since the launcher prints the one line.
- The launcher's death: a worker whose launcher was killed (kill -9, OOM killer) must not
  train on unsupervised, so each worker asks the kernel to SIGKILL it when its parent dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from types import FrameType

from titanlite.errors import LAUNCHER_PID_ENV  # the launcher's pid: whose death a worker follows (`die_with_launcher`)
from titanlite.logging import logger

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Stop requests: the launcher forwards them to its workers, which save and exit 0."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class StopSignals:
    """The signals this worker process received: a stop request (SIGTERM/SIGUSR1), Ctrl-C.

    One per process (`received`): signal handlers are process state. `install` replaces
    the handlers; `restore` puts the previous ones back, so a trainer built inside a test
    process leaves it as it found it.
    """

    def __init__(self) -> None:
        self.stop_signal = 0  # the first stop signal's number; 0: none
        self.interrupted = False
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> StopSignals:
        if not self._previous:
            for sig in (*FORWARDED_SIGNALS, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self.interrupted = True
            raise KeyboardInterrupt  # as without a handler
        if not self.stop_signal:
            self.stop_signal = signum
            # No promise of a checkpoint: the launcher also sends SIGTERM to the ranks left after a
            # peer died (kill -9), whose step never finishes; the line that ends the run says what was saved.
            logger.info(
                f"got {signal.Signals(signum).name}: stopping after this step (saved if checkpointing is on "
                "and every rank finishes it)"
            )


received = StopSignals()


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this worker when its launcher dies (Linux; `titanlite.launch`
    puts its pid in LAUNCHER_PID_ENV). A launcher that died before this call is caught by
    comparing the parent pid afterwards. Without the variable (a plain `python -m
    titanlite.train`, a foreign launcher) the worker keeps its own lifetime."""
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if expected is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        logger.warning(f"could not tie this worker to its launcher (prctl errno {ctypes.get_errno()})")
        return
    if os.getppid() != int(expected):
        os._exit(1)  # the launcher is already gone
