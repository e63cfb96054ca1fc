"""Pipeline parallelism: the model split into consecutive stages over the "pp" mesh dim,
run by a `torch.distributed.pipelining` schedule.

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

Stages per rank follow the schedule: one for 1F1B and GPipe, two or more placed round-robin
for the looped schedules (stage s on pp rank s % pp), exactly two in a V for ZBVZeroBubble
and DualPipeV (rank r holds stages r and 2pp-1-r). Everything a user can set wrong is checked
in `plan_layout`, from the config alone, before any device is touched.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.errors import TitanliteError
from titanlite.parallel.distributed import collective_timeout

FIELD = "parallelism.pipeline_parallel"
# How each schedule places stages on ranks: "single" (one per rank), "loop" (round-robin,
# two or more per rank), "v" (two per rank, in a V).
SCHEDULE_STYLES = {
    "1F1B": "single",
    "GPipe": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
# Schedules that need at least as many microbatches as stages (torch checks it at build).
_NEEDS_MICROBATCH_PER_STAGE = {"1F1B": "stages", "DualPipeV": "stages"}
# Schedules whose microbatches must divide into rounds of pp (torch checks it at build).
_ROUNDS = {"Interleaved1F1B", "InterleavedZeroBubble"}


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index, the keys of `model.layers` it holds, and whether it is
    the first (embedding) or the last (final norm, output, loss); `flops`: its training FLOPs
    per token when the split was balanced by them."""

    index: int
    blocks: tuple[str, ...]
    first: bool
    last: bool
    flops: float | None = None

    def describe(self) -> str:
        parts = (
            (["input"] if self.first else [])
            + ([_block_range(self.blocks)] if self.blocks else [])
            + (["output"] if self.last else [])
        )
        cost = "" if self.flops is None else f" ({self.flops / 1e6:,.1f} MFLOP/token)"
        return f"stage {self.index}: {' + '.join(parts)}{cost}"


def _block_range(blocks: tuple[str, ...]) -> str:
    return f"layers {blocks[0]}" if len(blocks) == 1 else f"layers {blocks[0]}-{blocks[-1]}"


@dataclass(frozen=True)
class PipelineLayout:
    """The stages of a run, which ranks hold them, and the microbatches of a schedule step."""

    schedule: str
    degree: int
    stages: tuple[StageSpec, ...]
    n_microbatches: int

    @property
    def stages_per_rank(self) -> int:
        return len(self.stages) // self.degree

    def stage_indices(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pp rank `pp_rank` holds, in schedule order."""
        if SCHEDULE_STYLES[self.schedule] == "v":
            return (pp_rank, 2 * self.degree - 1 - pp_rank)
        return tuple(pp_rank + s * self.degree for s in range(self.stages_per_rank))

    def last_stage_pp_rank(self) -> int:
        """The pp rank holding the last stage (which computes the loss)."""
        return next(r for r in range(self.degree) if len(self.stages) - 1 in self.stage_indices(r))

    def output_rank(self, world: DeviceMesh) -> int:
        """The lowest global rank of the `world` mesh (pp outermost) that holds the last stage:
        the one that takes the tests' NaN fault in training and samples in generation."""
        return int(world.mesh[self.last_stage_pp_rank()].min())

    def describe(self) -> str:
        return (
            f"pipeline {self.schedule}: {len(self.stages)} stages on {self.degree} ranks, "
            f"{self.n_microbatches} microbatches per schedule step; " + "; ".join(s.describe() for s in self.stages)
        )


def plan_layout(
    parallelism, n_layers: int, local_batch_size: int, part_costs: Sequence[float] | None = None
) -> PipelineLayout:
    """Stages and microbatches from `parallelism.pipeline_parallel_*`; a TitanliteError naming
    the key for any combination the schedule cannot run. `part_costs` (`part_flops`: the
    embedding, each block, the output) is what `pipeline_parallel_balance = "flops"` splits."""
    degree, schedule = parallelism.pipeline_parallel_degree, parallelism.pipeline_parallel_schedule
    style = SCHEDULE_STYLES[schedule]
    blocks = [str(i) for i in range(n_layers)]
    by_flops = parallelism.pipeline_parallel_balance == "flops"
    if parallelism.pipeline_parallel_split_points:
        if by_flops:
            raise TitanliteError(
                f'{FIELD}_split_points: set together with {FIELD}_balance = "flops", which chooses the '
                "boundaries itself; set one of them"
            )
        runs = _split_at(parallelism.pipeline_parallel_split_points, n_layers)
    elif by_flops:
        if part_costs is None or len(part_costs) != n_layers + 2:
            raise ValueError(
                f"plan_layout: balance by flops needs the costs of the embedding, the {n_layers} blocks and the output"
            )
        stage_cost = _StageCost(part_costs, _stage_count(parallelism, n_layers, style))
        runs = _cheapest_runs(stage_cost)
    else:
        runs = _balanced_runs(
            n_layers,
            _stage_count(parallelism, n_layers, style),
            parallelism.pipeline_parallel_first_stage_less_layers,
            parallelism.pipeline_parallel_last_stage_less_layers,
        )
    n_stages = len(runs)
    if n_stages % degree:
        raise TitanliteError(f"{FIELD}_degree: {n_stages} stages do not divide over {degree} pipeline ranks")
    per_rank = n_stages // degree
    wanted = {
        "single": "exactly 1 stage per rank",
        "loop": "at least 2 stages per rank",
        "v": "exactly 2 stages per rank (a V)",
    }[style]
    if (style == "single" and per_rank != 1) or (style == "loop" and per_rank < 2) or (style == "v" and per_rank != 2):
        raise TitanliteError(
            f"{FIELD}_schedule: {schedule} runs {wanted}, but the split gives {n_stages} stages on "
            f"{degree} ranks ({per_rank} per rank)"
        )
    stages = tuple(
        StageSpec(i, tuple(blocks[a:b]), i == 0, i == n_stages - 1, stage_cost(i, a, b) if by_flops else None)
        for i, (a, b) in enumerate(runs)
    )
    return PipelineLayout(schedule, degree, stages, _microbatches(parallelism, local_batch_size, n_stages, degree))


def _stage_count(parallelism, n_layers: int, style: str) -> int:
    per_stage = parallelism.pipeline_parallel_layers_per_stage
    if per_stage is None:
        return parallelism.pipeline_parallel_degree * (1 if style == "single" else 2)
    weight = (
        parallelism.pipeline_parallel_first_stage_less_layers + parallelism.pipeline_parallel_last_stage_less_layers
    )
    return math.ceil((n_layers + weight) / per_stage)


def _balanced_runs(n_layers: int, n_stages: int, first_less: int, last_less: int) -> list[tuple[int, int]]:
    """[start, stop) block ranges of `n_stages` stages, as even as they can be when the
    embedding counts as `first_less` blocks and the output as `last_less` (torchtitan's rule).
    The first or last stage may end up with no block (the embedding or the head alone)."""
    effective = n_layers + first_less + last_less
    if n_stages > effective:
        raise TitanliteError(
            f"{FIELD}_degree: {n_stages} stages for a model of {n_layers} blocks (plus the input and the "
            f"output, counted as {first_less} and {last_less}): too many stages"
        )
    base, extra = divmod(effective, n_stages)
    sizes = [base + (i < extra) for i in range(n_stages)]
    sizes[0] -= first_less
    sizes[-1] -= last_less
    for name, size, less in (("first", sizes[0], first_less), ("last", sizes[-1], last_less)):
        if size < 0:
            raise TitanliteError(
                f"{FIELD}_{name}_stage_less_layers: {less} is more than the {name} stage's share of "
                f"{size + less} (a model of {n_layers} blocks over {n_stages} stages)"
            )
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return list(zip(bounds, bounds[1:]))


class _StageCost:
    """The cost of a stage from the parts' costs = [embedding, block 0, ..., block n-1,
    output]: its blocks' (by prefix sums: the split below asks for many ranges), plus the
    embedding on the first stage and the output on the last of `n_stages`."""

    def __init__(self, costs: Sequence[float], n_stages: int):
        self.costs, self.n_stages, self.n_layers = costs, n_stages, len(costs) - 2
        self.prefix = [0.0]
        for cost in costs[1:-1]:
            self.prefix.append(self.prefix[-1] + cost)

    def __call__(self, stage: int, start: int, stop: int) -> float:
        return (
            self.prefix[stop]
            - self.prefix[start]
            + (self.costs[0] if stage == 0 else 0.0)
            + (self.costs[-1] if stage == self.n_stages - 1 else 0.0)
        )


def _cheapest_runs(stage_cost: _StageCost) -> list[tuple[int, int]]:
    """[start, stop) block ranges of `stage_cost.n_stages` consecutive stages whose largest
    cost is the smallest possible. As in torchtitan's rule, the first or the last stage may
    hold no block; a stage between them holds at least one.

    A stage's time is what paces a pipeline: the slowest stage sets every other stage's
    wait once per microbatch, so the split minimizes the largest stage, not the spread."""
    n_layers, n_stages = stage_cost.n_layers, stage_cost.n_stages
    if n_layers < n_stages - 2:
        raise TitanliteError(f"{FIELD}_degree: {n_stages} stages for a model of {n_layers} blocks: too many stages")
    if n_stages == 1:
        return [(0, n_layers)]
    # best[j]: the smallest largest-stage cost of stages 0..s covering blocks [0, j), with
    # cut[s][j] the start of stage s in that split (dynamic programming over stages).
    inf = float("inf")
    best = [stage_cost(0, 0, j) for j in range(n_layers + 1)]
    cuts: list[list[int]] = [[0] * (n_layers + 1)]
    for stage in range(1, n_stages):
        last = stage == n_stages - 1
        nxt, cut = [inf] * (n_layers + 1), [0] * (n_layers + 1)
        for stop in [n_layers] if last else range(n_layers + 1):
            for start in range(stop + (1 if last else 0)):  # a middle stage holds a block; the last may hold none
                value = max(best[start], stage_cost(stage, start, stop))
                if value < nxt[stop]:
                    nxt[stop], cut[stop] = value, start
        best = nxt
        cuts.append(cut)
    bounds = [n_layers]
    for stage in range(n_stages - 1, 0, -1):
        bounds.append(cuts[stage][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return list(zip(bounds, bounds[1:]))


def part_flops(
    model: nn.Module, attention_per_block: float, routed: Mapping[nn.Module, float] | None = None
) -> list[float]:
    """Training FLOPs per token of the model's pipeline parts: [the children before `layers`,
    each block, the children after it], 6 per matmul weight (an `nn.Linear`'s, and those of
    each module in `routed` times its share of the tokens: a routed expert stack's top_k /
    n_experts) plus `attention_per_block` in each block. A lookup (the embedding) counts
    nothing; the loss's elementwise work over the vocabulary is not counted. torchtitan weighs
    the embedding and the output as one block each (`*_less_layers`); at Llama 3 8B's
    128,256-token vocabulary the output alone is ~1.8 blocks at seq 8192, and more at shorter
    sequences."""
    routed = routed or {}

    def matmul_flops(module: nn.Module | None) -> float:
        if module is None:
            return 0.0
        flops = 0.0
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                flops += 6.0 * sum(p.numel() for p in sub.parameters())
            elif sub in routed:
                flops += 6.0 * sum(p.numel() for p in sub.parameters()) * routed[sub]
        return flops

    names = [name for name, _ in model.named_children()]
    at = names.index("layers")
    before = sum(matmul_flops(getattr(model, name)) for name in names[:at])
    after = sum(matmul_flops(getattr(model, name)) for name in names[at + 1 :])
    return [before, *(matmul_flops(block) + attention_per_block for block in model.layers.values()), after]


def _split_at(points: list[str], n_layers: int) -> list[tuple[int, int]]:
    """`layers.K` names: the first block of each stage after the first."""
    starts = []
    for point in points:
        prefix, _, number = point.partition(".")
        if prefix != "layers" or not number.isdigit() or not 0 < int(number) < n_layers:
            raise TitanliteError(f"{FIELD}_split_points: {point!r} is not a block layers.K with 0 < K < {n_layers}")
        starts.append(int(number))
    if starts != sorted(set(starts)):
        raise TitanliteError(f"{FIELD}_split_points: must increase, each named once (got {','.join(points)})")
    bounds = [0, *starts, n_layers]
    return list(zip(bounds, bounds[1:]))


def _microbatches(parallelism, local_batch_size: int, n_stages: int, degree: int) -> int:
    size = parallelism.pipeline_parallel_microbatch_size
    if local_batch_size % size:
        raise TitanliteError(
            f"{FIELD}_microbatch_size: {size} does not divide training.local_batch_size {local_batch_size}"
        )
    count, schedule = local_batch_size // size, parallelism.pipeline_parallel_schedule
    if schedule in _NEEDS_MICROBATCH_PER_STAGE and count < n_stages:
        raise TitanliteError(
            f"{FIELD}_microbatch_size: {schedule} needs at least one microbatch per stage ({n_stages}); "
            f"local_batch_size {local_batch_size} / microbatch size {size} gives {count}"
        )
    rounds = max(1, count // degree)
    if schedule in _ROUNDS and count % rounds:
        raise TitanliteError(
            f"{FIELD}_microbatch_size: {schedule} runs the microbatches in {rounds} rounds "
            f"(microbatches // pipeline degree {degree}) and needs {count} microbatches to split evenly into them"
        )
    return count


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
    before `layers` kept only on the first stage and those after it only on the last."""
    part = copy.deepcopy(model)
    names = [name for name, _ in part.named_children()]
    at = names.index("layers")
    for position, name in enumerate(names):
        if name == "layers":
            for key in [k for k in part.layers.keys() if k not in stage.blocks]:
                del part.layers[key]
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
            for name, child in part.named_children():
                if child is None:
                    continue
                if isinstance(child, nn.ModuleDict) and name in self._modules:
                    self._modules[name].update(child)
                elif isinstance(child, nn.ModuleDict):
                    self.add_module(name, nn.ModuleDict(dict(child.items())))
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
    indices = layout.stage_indices(pp_rank)
    stages = [
        PipelineStage(part, index, len(layout.stages), device, group=pp_group) for part, index in zip(parts, indices)
    ]
    if issubclass(schedule_class, PipelineScheduleSingle):
        return schedule_class(stages[0], n_microbatches=layout.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(stages, n_microbatches=layout.n_microbatches, loss_fn=loss_fn, scale_grads=False)


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
