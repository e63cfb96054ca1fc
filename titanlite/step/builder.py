"""The parallel plumbing of a training step, in one place: the trainer asks `StepBuilder` for
its forward-backward runner in one line, and for the loss every rank reports, and computes no
mesh group, rank or flag of its own (docs/architecture.md: the trainer stays a
composition root).

What it owns:

- the context-parallel helper: the mesh's one (`Meshes.context_parallel`), which
  `parallelize` also handed the model's attention, so the step cuts each batch to exactly the
  global positions the model rotates and masks at;
- the pipeline's group and loss rank: the lowest global rank that holds the last stage
  computes the loss (and takes the tests' NaN fault); a loss is summed over the pp group
  before it is averaged over the data- and context-parallel ranks;
- the document flag: the loaders hand out document ids when `model.attn_mask_type` is
  "block_causal", and the runners pass them to the model's forward;
- the loss: the compute context (autocast where FSDP does not own mixed precision) and the
  pipeline's `StepLoss`, to which each schedule call passes its scale; over masked labels
  (chat data), the count of the step's trained tokens over the loss group (`LabelCount`);
- mixture-of-experts layers (`experts`, from the built model): their aux loss trained in each
  forward, and `ExpertBalance` after each optimizer step, over the dp x cp ranks;
- multi-token prediction (`multi_token`): its objective, and its losses logged over the
  pipeline and dp x cp ranks.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titanlite.config import JobConfig
from titanlite.parallel.collectives import mean_over, sum_over
from titanlite.parallel.mesh import Meshes, ParallelDims
from titanlite.parallel.pipeline_plan import PipelineLayout
from titanlite.step.experts import ExpertBalance, ExpertLayers
from titanlite.step.forward_backward import Pipelined, Unpipelined
from titanlite.step.loss import LabelCount
from titanlite.step.mtp import MultiTokenPrediction
from titanlite.step.participants import StepParticipant
from titanlite.step.precision import autocast_dtype


@dataclass(frozen=True)
class StepBuilder:
    """What a step needs to know about the run's layout, derived once from the plan."""

    meshes: Meshes
    pipeline: PipelineLayout | None
    device: torch.device
    rank: int
    documents: bool  # windows come with document ids (block-causal attention)
    autocast: torch.dtype | None  # the compute dtype where FSDP does not cast; None: no autocast

    @classmethod
    def for_run(
        cls,
        cfg: JobConfig,
        *,
        dims: ParallelDims,
        pipeline: PipelineLayout | None,
        meshes: Meshes,
        device: torch.device,
        rank: int,
    ) -> StepBuilder:
        """From the run's config (compute dtype already concrete), degrees, stages and meshes."""
        autocast = autocast_dtype(cfg.training.mixed_precision_param, dims.fsdp_enabled)
        return cls(meshes, pipeline, device, rank, cfg.model.attn_mask_type == "block_causal", autocast)

    @property
    def loss_rank(self) -> int:
        """The global rank the NaN fault goes to: 0, or under pipeline parallelism the lowest
        rank that computes a loss (holds the last stage)."""
        return 0 if self.pipeline is None else self.pipeline.output_rank(self.meshes.world)

    @functools.cached_property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.meshes.pp.get_group() if self.meshes.pp is not None else None

    @functools.cached_property
    def loss_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold different tokens of one step: dp x cp."""
        return self.meshes.loss.get_group() if self.meshes.loss is not None else None

    def compute_context(self) -> contextlib.AbstractContextManager:
        """Autocast when FSDP (which owns mixed precision otherwise) is not applied. (Loss
        parallel needs no context: `cross_entropy` takes the vocab-sharded logits itself.)"""
        if self.autocast is not None:
            return torch.autocast(self.device.type, dtype=self.autocast)
        return contextlib.nullcontext()

    def forward_backward(
        self,
        model: nn.Module,
        parts: list[nn.Module],
        experts: ExpertLayers | None = None,
        masked: bool = False,
        mtp: MultiTokenPrediction | None = None,
    ) -> Unpipelined | Pipelined:
        """The step's forward and backward: on the whole `model`, or through the pipeline
        schedule over this rank's stage `parts`; with `experts`, training their aux loss; with
        `masked` labels (chat data), each loss over the step's trained tokens of the loss group;
        with `mtp` (`multi_token`), the multi-token prediction objective."""
        labels = LabelCount(self.loss_group) if masked else None
        fault = self.rank == self.loss_rank
        shared = (self.compute_context, self.device, fault, self.meshes.context_parallel, experts, labels, mtp)
        if self.pipeline is None:
            return Unpipelined(*shared, model)
        return Pipelined(*shared, self.pipeline, parts, self.meshes.pp)

    def multi_token(self, depths: int, weight: float) -> MultiTokenPrediction | None:
        """The objective of a model with `depths` multi-token prediction modules (None without),
        its parts logged over the pipeline and loss groups."""
        if depths == 0:
            return None
        return MultiTokenPrediction(depths, weight, group=self.loss_group, pp_group=self.pp_group, device=self.device)

    def expert_balance(self, model: nn.Module, experts: ExpertLayers | None) -> StepParticipant:
        """The step participant that updates the biases of `model`'s MoE layers and reports their
        load (one that does nothing without any): counts summed over the ranks that hold
        different tokens of a step, dp x cp (tp ranks route the same tokens; pp ranks hold other
        layers, combined only for the reported load)."""
        if experts is None:
            return StepParticipant()
        return ExpertBalance(experts, model, self.loss_group, self.pp_group, self.device)

    def reported(self, loss: torch.Tensor) -> float:
        """A loss as every rank reports it: summed over the pipeline ranks (only those with
        the last stage hold it), averaged over the data- and context-parallel ranks."""
        return mean_over(self.loss_group, sum_over(self.pp_group, loss)).item()
