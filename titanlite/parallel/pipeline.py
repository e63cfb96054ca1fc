"""Pipeline parallelism: the model split into consecutive stages over the "pp" mesh dim (as
`pipeline_plan.py` lays them out), run by a `torch.distributed.pipelining` schedule.

The split is generic over any model that keeps its repeated blocks in `model.layers` (a
ModuleDict, see `ModelSpec`): the children registered before `layers` (an embedding) belong to
the first stage, those after it (final norm, output head) to the last, and each stage holds a
run of consecutive blocks. A stage is a copy of the whole model (on meta) with the other
stages' children set to None and their blocks deleted, so

- every parameter keeps its name (`layers.5.attention.wq.weight` on whichever rank holds
  block 5): checkpoints do not depend on the pipeline layout and reshard to any other, and
  layout-independent init (models/init.py) fills the same values;
- the model's own `forward` runs a stage, as long as it skips None children (the contract in
  model_spec.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from titanlite.parallel.distributed import collective_timeout
from titanlite.parallel.pipeline_plan import PipelineLayout, StageSpec


def shared_parameters(model: nn.Module) -> list[str]:
    """Top-level children that share a parameter (a tied embedding and output head): they
    would sit on different stages, which cannot hold one tensor."""
    owners: dict[int, str] = {}
    shared = []
    for name, child in model.named_children():
        for param in child.parameters():
            if id(param) in owners and owners[id(param)] != name:
                shared.append(f"{owners[id(param)]} and {name}")
            owners.setdefault(id(param), name)
    return shared


def split_stage(model: nn.Module, stage: StageSpec) -> nn.Module:
    """A copy of `model` (on meta) holding only `stage`: the other blocks deleted, the children
    before `layers` kept only on the first stage and those after it only on the last; a child
    without parameters (a RoPE table) on every stage."""
    part = copy.deepcopy(model)
    names = [name for name, _ in part.named_children()]
    at = names.index("layers")
    for position, name in enumerate(names):
        if name == "layers":
            for key in [k for k in part.layers.keys() if k not in stage.blocks]:
                del part.layers[key]
        elif next(getattr(part, name).parameters(), None) is None:
            continue
        elif (position < at and not stage.first) or (position > at and not stage.last):
            setattr(part, name, None)
    return part


class ModelParts(nn.Module):
    """This rank's stage modules seen as one module under the whole model's names: what the
    optimizer, gradient clipping and checkpoints read (each part's children, the `layers` of
    all parts in one ModuleDict). It holds the parts' own modules, nothing copied; forward
    runs through the pipeline schedule, not here."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = parts  # a plain list: not registered, so names carry no part prefix
        for part in parts:
            for name, child in part.named_children():  # None children (other stages') are skipped
                if isinstance(child, nn.ModuleDict):  # `layers`: one ModuleDict of every part's blocks
                    self._modules.setdefault(name, nn.ModuleDict()).update(child)
                else:
                    self.add_module(name, child)

    def train(self, mode: bool = True) -> ModelParts:
        for part in self.parts:
            part.train(mode)
        self.training = mode
        return self

    def forward(self, *args, **kwargs):
        raise RuntimeError("ModelParts runs through the pipeline schedule (step/forward_backward.Pipelined)")


def build_schedule(
    layout: PipelineLayout,
    parts: list[nn.Module],
    pp_rank: int,
    pp_group,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """The `torch.distributed.pipelining` schedule over this rank's stage modules. Gradients
    are not scaled by the schedule: `loss_fn` carries the whole step's scale (microbatches and
    gradient accumulation), so accumulating over several schedule steps stays exact."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    schedule_class = get_schedule_class(layout.schedule)
    if device.type == "cpu":
        bound_p2p_waits()
    stages = [
        PipelineStage(part, index, len(layout.stages), device, group=pp_group)
        for part, index in zip(parts, layout.stage_indices(pp_rank))
    ]
    stage_or_stages = stages[0] if issubclass(schedule_class, PipelineScheduleSingle) else stages
    return schedule_class(stage_or_stages, n_microbatches=layout.n_microbatches, loss_fn=loss_fn, scale_grads=False)


def bound_p2p_waits() -> None:
    """Give the schedules' send/receive waits the run's collective timeout, on gloo.

    torch's schedules wait for their batched sends and receives with `Work.wait()`, which on
    gloo never times out (the group's timeout covers collectives only): a stopped peer stage
    would hang the others forever. With a timeout the wait raises like a collective does and
    the trainer turns it into its one line. NCCL is left alone: its watchdog already times
    out sends and receives, and a wait with a timeout would block the CPU on every one.
    This is the one place titanlite reaches into the pipelining module's internals; where the
    installed torch has no such function, waits stay as torch has them."""
    from torch.distributed.pipelining import schedules

    if hasattr(schedules, "_wait_batch_p2p") and not getattr(schedules._wait_batch_p2p, "bounded", False):
        schedules._wait_batch_p2p = wait_with_timeout


def wait_with_timeout(work: list) -> None:
    """Wait for sends and receives as long as the run's collective timeout (see above)."""
    timeout = collective_timeout()
    for handle in work:
        handle.wait(timeout) if timeout is not None else handle.wait()


wait_with_timeout.bounded = True
