"""Forward and backward over one optimizer step's microbatches, and the validation forward:
on the whole model (`Unpipelined`), or through a pipeline schedule over this rank's stages
(`Pipelined`).

A microbatch is (inputs, labels) or, for block-causal attention, (inputs, labels,
document_ids); under context parallelism each rank keeps its load-balanced share of the
inputs and labels (the document ids stay whole: attention needs every key's).

Both return this rank's loss of the step: the mean over the tokens of this dp rank's
microbatches where the loss is computed, 0 on pipeline ranks that hold no last stage (the
trainer sums over the pipeline ranks, then averages over the dp ranks). Gradients are those of
that mean either way: an accumulated step's microbatches weigh 1/accumulation each, and a
pipeline's loss function carries 1/(microbatches x accumulation), so the schedule scales
nothing and several schedule steps accumulate exactly. That scale and the step number are
arguments of each schedule call (`StepLoss`), not state set on the runner before it. Over masked
labels (chat data, `labels`), each of those losses is its trained tokens' sum over the step's
count (`step/loss.LabelCount`) instead of its mean, weighted as before.

A model with multi-token prediction blocks (`mtp`, step/mtp.py) reads each window with its
shifted copies and trains its objective; the loss reported is that objective.

A model with mixture-of-experts layers (`experts`) trains their aux loss in the same
forwards: each layer adds its gradient to the backward of its own output, weighted as that
forward's loss is (`step/experts.aux_loss_gradients`), so a pipeline schedule, whose loss
function sees only the last stage's logits, trains it too.

`step/builder.py` builds the one that fits the run's layout.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.data.loader import IGNORE
from titanlite.parallel.context_parallel import ContextParallel
from titanlite.parallel.fsdp import set_gradient_sync
from titanlite.parallel.pipeline import build_schedule
from titanlite.parallel.pipeline_plan import PipelineLayout
from titanlite.step.experts import ExpertLayers, aux_loss_gradients, uncounted_metadata_forwards
from titanlite.step.loss import LabelCount, cross_entropy
from titanlite.step.mtp import Divisors, MultiTokenPrediction, objective
from titanlite.step.nonfinite import inject_nan

Microbatch = tuple[torch.Tensor, ...]
ComputeContext = Callable[[], contextlib.AbstractContextManager]


def _model_kwargs(documents: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {} if documents is None else {"document_ids": documents}


@dataclass
class Runner:
    """What both runners share, in the order `StepBuilder.forward_backward` hands it over."""

    compute_context: ComputeContext
    device: torch.device
    nan_fault_here: bool  # this rank's loss takes the tests' NaN fault (step/nonfinite.py)
    context_parallel: ContextParallel | None
    experts: ExpertLayers | None
    label_count: LabelCount | None  # the labels are masked (chat data)
    mtp: MultiTokenPrediction | None  # the model has multi-token prediction modules (step/mtp.py)

    def on_device(self, batch: Microbatch, streams: bool = True) -> tuple:
        """(inputs, labels, document ids or None) on the device, with the MTP streams when the
        model trains them (`streams`), cut to this cp rank's tokens."""
        inputs, labels, *documents = (t.to(self.device, non_blocking=True) for t in batch)
        if self.mtp is not None and streams:
            inputs, labels = self.mtp.streams(inputs, 0), self.mtp.streams(labels, IGNORE)
            labels = self.mtp.within_documents(labels, documents[0]) if documents else labels
        if self.context_parallel is not None:
            inputs, labels = self.context_parallel.shard(inputs, dim=-1), self.context_parallel.shard(labels, dim=-1)
        return inputs, labels, (documents[0] if documents else None)

    def tokens(self, batches: list[tuple], losses: int) -> torch.Tensor | Divisors | None:
        """What each of this rank's `losses` losses of the step divides by: None (its mean) unless
        the labels are masked; with MTP streams, each depth's divisor too."""
        labels = [labels for _, labels, _ in batches]
        main = [label[:, 0] if label.ndim == 3 else label for label in labels]
        tokens = None if self.label_count is None else self.label_count(main, losses)
        return tokens if labels[0].ndim == 2 else self.mtp.divisors(tokens, labels, losses)


@dataclass
class Unpipelined(Runner):
    """Gradient accumulation on one model: FSDP reduces gradients once, after the last microbatch."""

    model: nn.Module

    def train(self, microbatches: list[Microbatch], step: int) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.device)
        batches = [self.on_device(batch) for batch in microbatches]
        tokens = self.tokens(batches, len(batches))
        with aux_loss_gradients(self.experts, [self.model], 1.0 / len(microbatches)):
            for index, (inputs, labels, documents) in enumerate(batches):
                set_gradient_sync(self.model, index == len(microbatches) - 1)
                with self.compute_context():
                    logits = self.model(inputs, **_model_kwargs(documents))
                    loss = objective(self.mtp, logits, labels, tokens, 1.0 / len(microbatches)) / len(microbatches)
                    loss = inject_nan(step, loss, self.nan_fault_here)
                    loss.backward()
                loss_sum += loss.detach()
        return loss_sum

    def evaluate(self, *batch: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of one batch, no gradient (the caller sets eval mode)."""
        inputs, labels, documents = self.on_device(batch, streams=False)
        tokens = self.tokens([(inputs, labels, documents)], 1)
        with torch.no_grad(), self.compute_context():
            return cross_entropy(self.model(inputs, **_model_kwargs(documents)), labels, tokens)


class StepLoss:
    """What a pipeline schedule computes on the last stage for each of its microbatches:
    cross-entropy (over `tokens` when the labels are masked), or with `mtp` its objective
    (step/mtp.py), times the call's scale, with the NaN fault on the loss rank. The scale, the
    tokens and the step come with each schedule call (`passing`) as the schedule's `loss_kwargs`."""

    def __init__(self, nan_fault_here: bool, mtp: MultiTokenPrediction | None = None):
        self.nan_fault_here, self.mtp = nan_fault_here, mtp
        self._held: dict[str, float | int] | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, **loss_kwargs: float | int) -> torch.Tensor:
        arguments = loss_kwargs or self._held
        scale = arguments["scale"]
        loss = objective(self.mtp, logits, labels, arguments["tokens"], scale) * scale
        return inject_nan(arguments["step"], loss, self.nan_fault_here)

    @contextlib.contextmanager
    def passing(self, schedule, scale: float, step: int, tokens: torch.Tensor | None) -> Iterator[dict]:
        """The keyword arguments that hand `scale`, `step` and `tokens` to this loss through one
        call of `schedule`. torch 2.11's schedules (the GPU machines') take no `loss_kwargs`:
        there they are held here for the length of the call only."""
        if "loss_kwargs" in inspect.signature(schedule.step).parameters:
            yield {"loss_kwargs": {"scale": scale, "step": step, "tokens": tokens}}
            return
        self._held = {"scale": scale, "step": step, "tokens": tokens}
        try:
            yield {}
        finally:
            self._held = None


@dataclass
class Pipelined(Runner):
    """One schedule step per accumulated microbatch; the schedule splits it into the
    pipeline's microbatches. The first stage is fed the inputs, the last the labels; a rank
    holding neither (a middle stage) only passes activations on."""

    layout: PipelineLayout
    parts: list[nn.Module]
    pp_mesh: DeviceMesh

    def __post_init__(self) -> None:
        pp_rank = self.pp_mesh.get_local_rank()
        held = self.layout.stage_indices(pp_rank)
        self.has_first, self.has_last = 0 in held, len(self.layout.stages) - 1 in held
        self.n_microbatches, self.loss = self.layout.n_microbatches, StepLoss(self.nan_fault_here, self.mtp)
        self.schedule = build_schedule(
            self.layout, self.parts, pp_rank, self.pp_mesh.get_group(), self.device, self.loss
        )
        # The last stage would otherwise keep every microbatch's logits to hand them back.
        self._no_outputs = (
            {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters else {}
        )

    def train(self, microbatches: list[Microbatch], step: int) -> torch.Tensor:
        scale = 1.0 / (self.n_microbatches * len(microbatches))
        loss_sum = torch.zeros((), device=self.device)
        batches = [self.on_device(batch) for batch in microbatches]
        tokens = self.tokens(batches, self.n_microbatches * len(batches))
        with aux_loss_gradients(self.experts, self.parts, scale):
            for batch in batches:
                loss_sum += self._run(self.schedule.step, batch, scale, step, tokens)
        return loss_sum

    def evaluate(self, *batch: torch.Tensor) -> torch.Tensor:
        batch = self.on_device(batch, streams=False)
        tokens = self.tokens([batch], self.n_microbatches)
        with torch.no_grad():
            return self._run(self.schedule.eval, batch, 1.0 / self.n_microbatches, 0, tokens)

    def _run(self, run: Callable, batch: tuple, scale: float, step: int, tokens: torch.Tensor | None) -> torch.Tensor:
        """One schedule step over a batch on the device; every stage gets the document ids (each
        of its blocks needs them)."""
        inputs, labels, documents = batch
        args = (inputs,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses, **self._no_outputs} if self.has_last else {}
        with (
            self.compute_context(),
            self.loss.passing(self.schedule, scale, step, tokens) as loss_arguments,
            uncounted_metadata_forwards(self.experts, self.parts, self.n_microbatches),
            self.mtp.returned_only(losses) if self.mtp is not None else contextlib.nullcontext(),
        ):
            run(*args, **kwargs, **loss_arguments, **_model_kwargs(documents))
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float().to(self.device) for loss in losses]).sum()
