"""The per-step agreement between ranks: one small all-reduce at the end of every step's
backward that every rank takes the same decisions from.

It carries three flags (MAX over the default group, one host sync): whether some rank's loss
is inf/nan, whether the grad norm is (`nonfinite.py` decides what to do about either), and
whether some rank was asked to stop (`runtime/preemption.py`: a signal may reach only some
ranks). It runs after clipping and before the optimizer step, so a bad step is never applied,
and the stop check costs no collective of its own.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    flags = torch.stack(
        [
            torch.tensor(float(stop_signal), device=loss.device),
            (~torch.isfinite(loss)).float(),
            (~torch.isfinite(grad_norm.to(loss.device))).float(),
        ]
    )
    if _world():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    stop, loss_bad, norm_bad = flags.tolist()
    return StepAgreement(int(stop), bool(loss_bad), bool(norm_bad))
