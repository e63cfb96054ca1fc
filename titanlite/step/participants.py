"""Step participants: what joins a training step optionally, at named points, without the
loop naming it.

The loop (`trainer.Trainer`) calls the run's participants, in order, at each point of every
step; a participant overrides only the points it needs (the others do nothing):

    resume(step)                after the checkpoint load, before the first step
    before_step(step, redo)     before the step draws its batches; again before a redo
    after_backward(params, loss) -> loss    between backward and clipping
    commit(step) -> bool        False: every rank redoes the step on the same batches
    after_optimizer_step(updated)           told whether the optimizer stepped
    log_fields() -> [LineField] their part of a logged step's line and scalars
    after_step(step, last)      after the step is logged
    close()                     when the trainer closes

The run's own are fault tolerance (`runtime/fault_tolerance.py`, there and doing nothing
when off), expert balance (`step/experts.py`), float8 scales (`Float8Scales` below),
validation (`step/validate.py`), checkpoints (`startup.Checkpointing`) and the scheduled
garbage collector (`runtime/gc_schedule.py`); a user's come after them
(`Trainer(plan, participants=[...])`, `startup.build_run`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from titanlite.observe.metrics import LineField
from titanlite.parallel.float8 import precompute_scales


class StepParticipant:
    """One participant: every point a no-op (see the module doc for when each is called)."""

    def resume(self, step: int) -> None:
        """Training starts after `step` (0, or the step the checkpoint held)."""

    def before_step(self, step: int, redo: bool = False) -> None:
        """Step `step` is about to draw its batches, or (`redo`) to run again on the same ones."""

    def after_backward(self, params: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """The gradients of `params` are in; returns the step's loss (this one, or a replacement)."""
        return loss

    def commit(self, step: int) -> bool:
        """Whether this step may update the weights; False has it redone."""
        return True

    def after_optimizer_step(self, updated: bool) -> None:
        """The optimizer stepped (`updated`), or skipped a non-finite step."""

    def log_fields(self) -> list[LineField]:
        """Extra fields of the step line (called on every rank at each logged step)."""
        return []

    def after_step(self, step: int, last: bool) -> None:
        """Step `step` is done and logged; `last`: it is the run's last."""

    def close(self) -> None:
        """The trainer closes."""


class Participants(StepParticipant):
    """The run's participants, each point called on every one in order."""

    def __init__(self, members: Iterable[StepParticipant]) -> None:
        self.members = list(members)

    def resume(self, step: int) -> None:
        for member in self.members:
            member.resume(step)

    def before_step(self, step: int, redo: bool = False) -> None:
        for member in self.members:
            member.before_step(step, redo)

    def after_backward(self, params: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        for member in self.members:
            loss = member.after_backward(params, loss)
        return loss

    def commit(self, step: int) -> bool:
        return all([member.commit(step) for member in self.members])  # each asked: a decision may be collective

    def after_optimizer_step(self, updated: bool) -> None:
        for member in self.members:
            member.after_optimizer_step(updated)

    def log_fields(self) -> list[LineField]:
        return [field for member in self.members for field in member.log_fields()]

    def after_step(self, step: int, last: bool) -> None:
        for member in self.members:
            member.after_step(step, last)

    def close(self) -> None:
        for member in self.members:
            member.close()


class Float8Scales(StepParticipant):
    """Before each forward pass of a step (a redo's too): every float8-gathered weight's scale
    in one all-reduce (`parallel/float8.precompute_scales`), from the weights as they are."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def before_step(self, step: int, redo: bool = False) -> None:
        precompute_scales(self.parts)
