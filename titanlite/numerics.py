"""Non-finite losses and gradient norms: found on any rank, agreed by all, then the run
stops (or, within `training.max_nan_skips`, skips the step).

Every step ends with one small all-reduce (MAX over the default group, one host sync)
that every rank takes the same decision from: whether some rank's loss is inf/nan,
whether the grad norm is, and whether some rank was asked to stop (`preemption.py`: a
signal may reach only some ranks). It runs after clipping and before the optimizer step,
so a bad step is never applied, and the stop check costs no collective of its own.

A stopped run raises `NonFiniteError` (one line, exit 2) before the optimizer step and
before that step's checkpoint, so the newest checkpoint holds the last finite state.

Fault injection, for tests: `TITANLITE_FAULT_NAN_AT_STEP=k` multiplies global rank 0's
loss by NaN at step k before backward (its gradients, then everyone's grad norm, follow).
Only rank 0's loss is touched, so the other ranks learn of it through the agreement.
Nothing else reads it.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.errors import TitanliteError
from titanlite.logging import logger

FAULT_NAN_ENV = "TITANLITE_FAULT_NAN_AT_STEP"


class NonFiniteError(TitanliteError):
    """The loss or grad norm became inf/nan and no skip is left: one line, exit 2."""


@dataclass(frozen=True)
class StepAgreement:
    """What every rank agreed on at the end of a step's backward."""

    stop_signal: int  # the number of a stop signal some rank got (0: none)
    loss_nonfinite: bool  # on at least one rank
    grad_norm_nonfinite: bool

    @property
    def finite(self) -> bool:
        return not (self.loss_nonfinite or self.grad_norm_nonfinite)

    @property
    def stop(self) -> bool:
        return self.stop_signal != 0

    def stop_signal_name(self) -> str:
        return signal.Signals(self.stop_signal).name


def _world() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def agree_on_step(stop_signal: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> StepAgreement:
    """One all-reduce (MAX) of [stop signal, loss not finite, grad norm not finite]."""
    flags = torch.stack([
        torch.tensor(float(stop_signal), device=loss.device),
        (~torch.isfinite(loss)).float(),
        (~torch.isfinite(grad_norm.to(loss.device))).float(),
    ])  # fmt: skip
    if _world():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    stop, loss_bad, norm_bad = flags.tolist()
    return StepAgreement(int(stop), bool(loss_bad), bool(norm_bad))


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
        what = " and ".join(
            name for name, bad in (("loss", agreement.loss_nonfinite), (f"grad_norm ({grad_norm.item():g})", agreement.grad_norm_nonfinite)) if bad
        )
        if self.skipped >= self.max_skips:
            raise NonFiniteError(
                f"step {step}: non-finite {what}; stopped before the optimizer step, nothing of this step was saved "
                f"({self.skipped} of training.max_nan_skips {self.max_skips} skips used)"
            )
        self.skipped += 1
        if self.rank == 0:
            logger.warning(f"step {step}: non-finite {what}: optimizer step skipped ({self.skipped} of training.max_nan_skips {self.max_skips})")
        return False


def inject_nan(step: int, loss: torch.Tensor) -> torch.Tensor:
    """The fault-injection hook of the module doc: NaN into global rank 0's loss at step k."""
    value = os.environ.get(FAULT_NAN_ENV)
    if not value:
        return loss
    try:
        at_step = int(value)
    except ValueError:
        raise TitanliteError(f"{FAULT_NAN_ENV}: expected a step number (got {value!r})") from None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return loss * float("nan") if step == at_step and rank == 0 else loss
