"""Python's garbage collector at the same steps on every rank (`training.gc_freq`).

Left automatic, the collector runs whenever a rank's count of new container objects
crosses its threshold: at a different moment on each rank, and in a layout whose ranks
meet after every sub-layer (TP) or every gradient reduction, the others wait while one
collects. torchtitan's `training.gc_freq` is the same schedule: automatic collection off for
the training loop, a young-generation collection on every rank every `gc_freq` steps.
Objects that survive into the oldest generation are left until the trainer closes, when
automatic collection comes back. The debug model makes little garbage (a probe measured
4-5 ms of collection in 26 s on a TP 2 rank, docs/performance.md); a large model's autograd
graph and DTensor specs make far more.
"""

from __future__ import annotations

import gc

from titanlite.step.participants import StepParticipant

COLLECTED_GENERATION = 1
"""Young and middle generations: where one step's short-lived objects are (torchtitan's choice)."""


class ScheduledGC(StepParticipant):
    """A step participant: from `resume` (the loop's start) to `close`, automatic collection is
    off and `after_step` collects every `every` steps; 0 leaves Python's automatic collection
    as it is."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._was_enabled: bool | None = None  # whether to turn automatic collection back on at close

    def resume(self, step: int) -> None:
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect(COLLECTED_GENERATION)  # what start-up left, before the first step

    def after_step(self, step: int, last: bool) -> None:
        if self.every and step % self.every == 0:
            gc.collect(COLLECTED_GENERATION)

    def close(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
