"""A step's part in training mixture-of-experts layers, for any model that has them: the aux
loss's gradient in every forward, the expert-bias update after every optimizer step, and the
expert load the log line reports.

The layers' own functions live with the layer (`titanlite/models/moe.py`); this package sits
below the models and reaches them through `ExpertLayers`, which `build.build_model` hands the
trainer (`BuiltModel.experts`) when the built model has MoE layers, and None otherwise (a
dense flavor of an MoE family too). Which ranks' tokens an update sums over, and how load is
combined across pipeline stages, is layout knowledge, kept here with the step's other
parallel plumbing (`StepBuilder.expert_balance`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from titanlite.observe.metrics import LineField
from titanlite.step.participants import StepParticipant


class ExpertLayers(Protocol):
    """What the step calls on a model's MoE layers (models/moe.py provides these functions)."""

    def aux_loss_gradients(self, model: nn.Module, scale: float) -> contextlib.AbstractContextManager: ...

    def update_expert_biases(self, model: nn.Module, group: dist.ProcessGroup | None) -> dict[str, float]: ...

    def drop_expert_counts(self, model: nn.Module) -> None: ...

    def token_counts(self, model: nn.Module) -> torch.Tensor: ...

    def discount_tokens(self, model: nn.Module, counts: torch.Tensor) -> None: ...


def aux_loss_gradients(
    experts: ExpertLayers | None, parts: Iterable[nn.Module], scale: float
) -> contextlib.AbstractContextManager:
    """The context in which the forwards and backwards of `parts` (a model, or this rank's
    pipeline stages) train the aux loss weighted `scale`, the weight the step gives each
    forward's loss; nothing without MoE layers."""
    stack = contextlib.ExitStack()
    if experts is not None:
        for part in parts:
            stack.enter_context(experts.aux_loss_gradients(part, scale))
    return stack


@contextlib.contextmanager
def uncounted_metadata_forwards(
    experts: ExpertLayers | None, parts: list[nn.Module], n_microbatches: int
) -> Iterator[None]:
    """Around one pipeline schedule call: keep the MoE token counts of its microbatches only.

    torch 2.13's pipeline stages learn their inputs' and outputs' shapes by running each stage
    forward once more, on the first call and after every switch between training and
    evaluation (dynamic metadata inference: the first stage on its first microbatch, later
    stages on uninitialized tensors), in training mode, so MoE layers would count tokens no
    microbatch routed. The metadata forward comes first; a stage that ran `n_microbatches` + 1
    forwards has its first forward's counts taken out again. (Static stage shapes would skip
    the inference, but need every stage's output layout spelled out for every parallel plan.)"""
    if experts is None:
        yield
        return
    calls = {id(part): 0 for part in parts}
    first: dict[int, torch.Tensor] = {}

    def before(part: nn.Module, _args) -> None:
        if calls[id(part)] == 0:
            first[id(part)] = experts.token_counts(part)

    def after(part: nn.Module, _args, _output) -> None:
        calls[id(part)] += 1
        if calls[id(part)] == 1:
            first[id(part)] = experts.token_counts(part) - first[id(part)]

    hooks = [h for part in parts for h in (part.register_forward_pre_hook(before), part.register_forward_hook(after))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    for part in parts:
        if calls[id(part)] > n_microbatches:
            experts.discount_tokens(part, first[id(part)])


def load_field(mean: float, peak: float) -> LineField:
    """The step line's `moe_load mean/max` and the scalars moe_load_mean, moe_load_max: over the
    MoE layers, each layer's max / mean tokens per expert in the last step (1.0 is even load)."""
    return LineField(f"moe_load {mean:.2f}/{peak:.2f}", {"moe_load_mean": mean, "moe_load_max": peak})


@dataclass
class ExpertBalance(StepParticipant):
    """A step participant: after each optimizer step, the token counts of every MoE layer summed
    over `group` (the ranks that see different tokens: data x context parallel), each expert
    bias moved, and the per-layer load (max / mean tokens per expert) kept for the next log line."""

    experts: ExpertLayers
    model: nn.Module  # this rank's model (its pipeline stages seen as one)
    group: dist.ProcessGroup | None  # dp x cp
    pp_group: dist.ProcessGroup | None  # other stages hold other layers
    device: torch.device
    loads: dict[str, float] = field(default_factory=dict)

    def before_step(self, step: int, redo: bool = False) -> None:
        """A step redone (a peer replica group failed during it) counts its tokens again."""
        if redo:
            self.experts.drop_expert_counts(self.model)

    def after_optimizer_step(self, updated: bool) -> None:
        """Close the step's counts: update the biases if the optimizer stepped, else drop the
        counts (a skipped step's routing steers nothing)."""
        if updated:
            self.loads = self.experts.update_expert_biases(self.model, self.group)
        else:
            self.experts.drop_expert_counts(self.model)

    def log_fields(self) -> list[LineField]:
        """The load: (mean, max) over every MoE layer of the model, all pipeline stages
        (collective over the pp group), of each layer's max / mean tokens per expert at the last
        update."""
        values = torch.tensor(list(self.loads.values()), dtype=torch.float64, device=self.device)
        total = torch.stack([values.sum(), torch.tensor(float(len(values)), dtype=torch.float64, device=self.device)])
        peak = values.max() if len(values) else torch.zeros((), dtype=torch.float64, device=self.device)
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.pp_group)
        return [load_field(float(total[0] / total[1]), float(peak))]
