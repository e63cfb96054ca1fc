"""Validation: loss and perplexity on the validation windows, every `validation.freq` steps.

Each evaluation reads the same windows (the first `batches` global batches of the validation
stream; dp rank r its share of each), with the model in eval mode and no gradient, through the
training step's forward (step/forward_backward.py: its compute context, loss parallel under TP,
the pipeline schedule's forward-only pass under PP). The loss is the mean over every validation
window of every dp rank. It reads batches by position, not through the training loader, and
forks the RNG around the forward passes, so the training data position and random state are
exactly what they would be without validation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from titanlite.config import Validation
from titanlite.data.loader import TokenWindowLoader
from titanlite.errors import TitanliteError
from titanlite.logging import logger
from titanlite.observe.metrics import MetricsLogger
from titanlite.step.forward_backward import Pipelined, Unpipelined
from titanlite.step.participants import StepParticipant

Reduce = Callable[[torch.Tensor], float]
"""This rank's loss -> the loss over every rank (pipeline ranks summed, dp ranks averaged)."""


class Validator(StepParticipant):
    """Evaluates the first `batches` global batches of the validation stream on demand; as a
    step participant, after every `validation.freq`-th step and the last. Made only when
    validation is on; `loader` None (nothing held out) is a one-line error."""

    def __init__(
        self,
        cfg: Validation,
        loader: TokenWindowLoader | None,
        model: torch.nn.Module,
        runner: Unpipelined | Pipelined,
        reduce: Reduce,
        metrics: MetricsLogger,
    ) -> None:
        if loader is None:
            raise TitanliteError(
                f"validation.holdout_fraction: {cfg.holdout_fraction} of the training windows holds out no "
                "window (too little data); raise it or set validation.dataset"
            )
        self.freq, self.loader, self.model = cfg.freq, loader, model
        self.runner, self.reduce, self.device, self.metrics = runner, reduce, runner.device, metrics
        windows, per_batch = len(loader.stream), loader.global_batch
        available = windows // per_batch
        if available < 1:
            raise TitanliteError(
                f"validation: {loader.stream.name} has {windows} windows, fewer than one validation batch "
                f"of {per_batch} (local_batch_size x dp degree)"
            )
        self.batches = available if cfg.steps == -1 else min(cfg.steps, available)
        if cfg.steps > available:
            logger.warning(
                f"validation: {cfg.steps} steps asked, {loader.stream.name} holds {available}; validating on "
                f"{available}"
            )

    def after_step(self, step: int, last: bool) -> None:
        if step % self.freq == 0 or last:
            loss = self.evaluate()
            self.metrics.log_validation(step, loss, math.exp(loss) if loss < 700 else math.inf)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean cross-entropy over the validation windows of every dp rank."""
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for batch in range(self.batches):
                total += self.runner.evaluate(*self.loader.batch_at(batch * self.loader.global_batch))
        self.model.train(was_training)
        return self.reduce(total) / self.batches
