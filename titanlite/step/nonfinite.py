"""Non-finite losses and gradient norms: found on any rank, agreed by all (`agreement.py`),
then the run stops, or, within `training.max_nan_skips`, skips the step.

A stopped run raises `NonFiniteError` (one line, exit 2) before the optimizer step and
before that step's checkpoint, so the newest checkpoint holds the last finite state.

Fault injection, for tests: `TITANLITE_FAULT_NAN_AT_STEP=k` multiplies one rank's loss by
NaN at step k before backward (its gradients, then everyone's grad norm, follow): global
rank 0's, or under pipeline parallelism the lowest rank's that computes a loss. Only that
loss is touched, so the other ranks learn of it through the agreement.
Nothing else reads it.
"""

from __future__ import annotations

import os

import torch

from titanlite.errors import TitanliteError
from titanlite.logging import logger
from titanlite.step.agreement import StepAgreement

FAULT_NAN_ENV = "TITANLITE_FAULT_NAN_AT_STEP"


class NonFiniteError(TitanliteError):
    """The loss or grad norm became inf/nan and no skip is left: one line, exit 2."""


class NonFiniteSteps:
    """`training.max_nan_skips`: how many non-finite steps are skipped before the run stops."""

    def __init__(self, max_skips: int, rank: int):
        self.max_skips = max_skips
        self.rank = rank
        self.skipped = 0

    def allows_update(self, step: int, agreement: StepAgreement, grad_norm: torch.Tensor) -> bool:
        """True: apply the step. False: skip it (logged, counted). Raises `NonFiniteError`
        when no skip is left."""
        if agreement.finite:
            return True
        found = [
            ("loss", agreement.loss_nonfinite),
            (f"grad_norm ({grad_norm.item():g})", agreement.grad_norm_nonfinite),
        ]
        what = " and ".join(name for name, bad in found if bad)
        if self.skipped >= self.max_skips:
            raise NonFiniteError(
                f"step {step}: non-finite {what}; stopped before the optimizer step, nothing of this step was saved "
                f"({self.skipped} of training.max_nan_skips {self.max_skips} skips used)"
            )
        self.skipped += 1
        if self.rank == 0:
            logger.warning(
                f"step {step}: non-finite {what}: optimizer step skipped ({self.skipped} of training.max_nan_skips "
                f"{self.max_skips})"
            )
        return False


def inject_nan(step: int, loss: torch.Tensor, here: bool) -> torch.Tensor:
    """The fault-injection hook of the module doc: NaN into the loss at step k on the one
    rank the caller says (`here`): global rank 0, or under pipeline parallelism the lowest
    rank that computes a loss."""
    value = os.environ.get(FAULT_NAN_ENV)
    if not value:
        return loss
    try:
        at_step = int(value)
    except ValueError:
        raise TitanliteError(f"{FAULT_NAN_ENV}: expected a step number (got {value!r})") from None
    return loss * float("nan") if step == at_step and here else loss
