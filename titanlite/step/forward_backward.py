"""Forward and backward over one optimizer step's microbatches, and the validation forward:
on the whole model (`Unpipelined`), or through a pipeline schedule over this rank's stages
(`Pipelined`).

Both return this rank's loss of the step: the mean over the tokens of this dp rank's
microbatches where the loss is computed, 0 on pipeline ranks that hold no last stage (the
trainer sums over the pipeline ranks, then averages over the dp ranks). Gradients are those of
that mean either way: an accumulated step's microbatches weigh 1/accumulation each, and a
pipeline's loss function carries 1/(microbatches x accumulation), so the schedule scales
nothing and several schedule steps accumulate exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.parallel.fsdp import set_gradient_sync
from titanlite.parallel.pipeline import PipelineLayout, build_schedule
from titanlite.step.loss import cross_entropy
from titanlite.step.nonfinite import inject_nan

Microbatch = tuple[torch.Tensor, torch.Tensor]
ComputeContext = Callable[[], contextlib.AbstractContextManager]


class Unpipelined:
    """Gradient accumulation on one model: FSDP reduces gradients once, after the last microbatch."""

    def __init__(self, model: nn.Module, compute_context: ComputeContext, device: torch.device, nan_fault_here: bool):
        self.model, self.compute_context, self.device, self.nan_fault_here = model, compute_context, device, nan_fault_here

    def train(self, microbatches: list[Microbatch], step: int) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.device)
        for index, (inputs, labels) in enumerate(microbatches):
            set_gradient_sync(self.model, index == len(microbatches) - 1)
            inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            with self.compute_context():
                loss = cross_entropy(self.model(inputs), labels) / len(microbatches)
                loss = inject_nan(step, loss, self.nan_fault_here)
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of one batch, no gradient (the caller sets eval mode)."""
        inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        with torch.no_grad(), self.compute_context():
            return cross_entropy(self.model(inputs), labels)


class Pipelined:
    """One schedule step per accumulated microbatch; the schedule splits it into the
    pipeline's microbatches. The first stage is fed the inputs, the last the labels; a rank
    holding neither (a middle stage) only passes activations on."""

    def __init__(self, layout: PipelineLayout, parts: list[nn.Module], pp_mesh: DeviceMesh, compute_context: ComputeContext,
                 device: torch.device, nan_fault_here: bool):
        pp_rank = pp_mesh.get_local_rank()
        held = layout.stage_indices(pp_rank)
        self.has_first, self.has_last = 0 in held, len(layout.stages) - 1 in held
        self.n_microbatches, self.compute_context, self.device = layout.n_microbatches, compute_context, device
        self.nan_fault_here = nan_fault_here
        self._scale, self._step = 1.0, 0
        self.schedule = build_schedule(layout, parts, pp_rank, pp_mesh.get_group(), device, self.loss_fn)

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """What the schedule calls on the last stage for each of its microbatches."""
        return inject_nan(self._step, cross_entropy(logits, labels) * self._scale, self.nan_fault_here)

    def train(self, microbatches: list[Microbatch], step: int) -> torch.Tensor:
        self._scale, self._step = 1.0 / (self.n_microbatches * len(microbatches)), step
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in microbatches:
            loss_sum += self._run(self.schedule.step, inputs, labels)
        return loss_sum

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._scale, self._step = 1.0 / self.n_microbatches, 0
        with torch.no_grad():
            return self._run(self.schedule.eval, inputs, labels)

    def _run(self, run: Callable, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        args = (inputs.to(self.device, non_blocking=True),) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels.to(self.device, non_blocking=True), "losses": losses} if self.has_last else {}
        with self.compute_context():
            run(*args, **kwargs)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float().to(self.device) for loss in losses]).sum()
