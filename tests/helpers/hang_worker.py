"""`python -m tests.helpers.hang_worker [titanlite.train args]`: the trainer, with one rank stuck in
its own code at the start of a step, outside any collective: TITANLITE_TEST_HANG="RANK:STEP:spin"
(a busy loop) or "RANK:STEP:deadlock" (a lock taken twice)."""

from __future__ import annotations

import os
import sys
import threading

from titanlite import train
from titanlite.trainer import Trainer


def hang(kind: str) -> None:
    """Never returns: spins, or waits on a lock it holds itself."""
    if kind == "spin":
        while True:
            pass
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def main() -> int:
    rank, step, kind = os.environ["TITANLITE_TEST_HANG"].split(":")
    train_step = Trainer.train_step

    def train_step_that_hangs(self, microbatches):
        if self.dist.rank == int(rank) and self.state.step == int(step):
            hang(kind)
        return train_step(self, microbatches)

    Trainer.train_step = train_step_that_hangs
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
