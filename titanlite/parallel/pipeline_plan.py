"""The pipeline plan: which blocks each stage holds, which pp rank holds each stage, and the
microbatches of a schedule step, from the config alone, before any device is touched.

Stages hold runs of consecutive blocks of `model.layers`; the embedding belongs to the first
stage and the final norm and output head to the last (`pipeline.split_stage` cuts the model
so). Stages per rank follow the schedule: one for 1F1B and GPipe, two or more placed
round-robin for the looped schedules (stage s on pp rank s % pp), exactly two in a V for
ZBVZeroBubble and DualPipeV (rank r holds stages r and 2pp-1-r). The blocks are split evenly
(the embedding and the output counted as `*_less_layers` blocks, torchtitan's rule), at
`split_points`, or by FLOPs (`part_flops`: the slowest stage as cheap as it can be).
Everything a user can set wrong is checked in `plan_layout`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.errors import TitanliteError

FIELD = "parallelism.pipeline_parallel"
# How each schedule places stages on ranks: "single" (one per rank), "loop" (round-robin,
# two or more per rank), "v" (two per rank, in a V).
SCHEDULE_STYLES = {
    **dict.fromkeys(("1F1B", "GPipe"), "single"),
    **dict.fromkeys(("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"), "loop"),
    **dict.fromkeys(("ZBVZeroBubble", "DualPipeV"), "v"),
}
# Schedules that need at least as many microbatches as stages (torch checks it at build).
_NEEDS_MICROBATCH_PER_STAGE = {"1F1B", "DualPipeV"}
# Schedules whose microbatches must divide into rounds of pp (torch checks it at build).
_ROUNDS = {"Interleaved1F1B", "InterleavedZeroBubble"}
Runs = list[tuple[int, int]]  # [start, stop) block ranges, one per stage


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
        ends = self.blocks[:1] + self.blocks[1:][-1:]  # the first block and, when there are more, the last
        blocks = [f"layers {'-'.join(ends)}"] if ends else []
        parts = (["input"] if self.first else []) + blocks + (["output"] if self.last else [])
        cost = "" if self.flops is None else f" ({self.flops / 1e6:,.1f} MFLOP/token)"
        return f"stage {self.index}: {' + '.join(parts)}{cost}"


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

    def holder(self, stage: int) -> int:
        """The pp rank that holds stage `stage`."""
        return next(r for r in range(self.degree) if stage in self.stage_indices(r))

    def last_stage_pp_rank(self) -> int:
        """The pp rank holding the last stage (which computes the loss)."""
        return self.holder(len(self.stages) - 1)

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
    parallelism, n_layers: int, local_batch_size: int, part_costs: Sequence[float] | None = None, tail_blocks: int = 0
) -> PipelineLayout:
    """Stages and microbatches from `parallelism.pipeline_parallel_*`; a TitanliteError naming
    the key for any combination the schedule cannot run. `part_costs` (`part_flops`: the
    embedding, each block, the output) is what `pipeline_parallel_balance = "flops"` splits.
    `tail_blocks`: blocks numbered after the `n_layers` that run after the output and so sit on
    the last stage with it (multi-token prediction's), their cost the output's."""
    degree, schedule = parallelism.pipeline_parallel_degree, parallelism.pipeline_parallel_schedule
    runs, stage_cost = _runs(parallelism, n_layers, part_costs)
    n_stages = len(runs)
    _check_stages_per_rank(schedule, n_stages, degree)
    blocks = [str(i) for i in range(n_layers + tail_blocks)]
    runs = [*runs[:-1], (runs[-1][0], runs[-1][1] + tail_blocks)]
    costs = [stage_cost(i, a, min(b, n_layers)) if stage_cost else None for i, (a, b) in enumerate(runs)]
    stages = tuple(
        StageSpec(i, tuple(blocks[a:b]), i == 0, i == n_stages - 1, costs[i]) for i, (a, b) in enumerate(runs)
    )
    return PipelineLayout(schedule, degree, stages, _microbatches(parallelism, local_batch_size, n_stages, degree))


def _runs(parallelism, n_layers: int, part_costs: Sequence[float] | None) -> tuple[Runs, _StageCost | None]:
    """Each stage's blocks: at the split points, balanced by FLOPs (with the stage cost that
    balanced them), or evenly."""
    by_flops = parallelism.pipeline_parallel_balance == "flops"
    if parallelism.pipeline_parallel_split_points:
        if by_flops:
            raise TitanliteError(
                f'{FIELD}_split_points: set together with {FIELD}_balance = "flops", which chooses the '
                "boundaries itself; set one of them"
            )
        return _split_at(parallelism.pipeline_parallel_split_points, n_layers), None
    first_less = parallelism.pipeline_parallel_first_stage_less_layers
    last_less = parallelism.pipeline_parallel_last_stage_less_layers
    per_rank = 1 if SCHEDULE_STYLES[parallelism.pipeline_parallel_schedule] == "single" else 2
    n_stages = parallelism.pipeline_parallel_degree * per_rank
    if parallelism.pipeline_parallel_layers_per_stage is not None:
        n_stages = math.ceil((n_layers + first_less + last_less) / parallelism.pipeline_parallel_layers_per_stage)
    if not by_flops:
        return _balanced_runs(n_layers, n_stages, first_less, last_less), None
    if part_costs is None or len(part_costs) != n_layers + 2:
        raise ValueError(
            f"plan_layout: balance by flops needs the costs of the embedding, the {n_layers} blocks and the output"
        )
    stage_cost = _StageCost(part_costs, n_stages)
    return _cheapest_runs(stage_cost), stage_cost


def _check_stages_per_rank(schedule: str, n_stages: int, degree: int) -> None:
    if n_stages % degree:
        raise TitanliteError(f"{FIELD}_degree: {n_stages} stages do not divide over {degree} pipeline ranks")
    per_rank = n_stages // degree
    ok, wanted = {
        "single": (per_rank == 1, "exactly 1 stage per rank"),
        "loop": (per_rank >= 2, "at least 2 stages per rank"),
        "v": (per_rank == 2, "exactly 2 stages per rank (a V)"),
    }[SCHEDULE_STYLES[schedule]]
    if not ok:
        raise TitanliteError(
            f"{FIELD}_schedule: {schedule} runs {wanted}, but the split gives {n_stages} stages on "
            f"{degree} ranks ({per_rank} per rank)"
        )


def _balanced_runs(n_layers: int, n_stages: int, first_less: int, last_less: int) -> Runs:
    """`n_stages` stages as even as they can be when the embedding counts as `first_less`
    blocks and the output as `last_less` (torchtitan's rule). The first or last stage may end
    up with no block (the embedding or the head alone)."""
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
    return _between([0, *itertools.accumulate(sizes)])


def _between(bounds: list[int]) -> Runs:
    return list(zip(bounds, bounds[1:]))


class _StageCost:
    """The cost of a stage from the parts' costs = [embedding, block 0, ..., block n-1,
    output]: its blocks' (by prefix sums: the split below asks for many ranges), plus the
    embedding on the first stage and the output on the last of `n_stages`."""

    def __init__(self, costs: Sequence[float], n_stages: int):
        self.costs, self.n_stages, self.n_layers = costs, n_stages, len(costs) - 2
        self.prefix = list(itertools.accumulate(costs[1:-1], initial=0.0))

    def __call__(self, stage: int, start: int, stop: int) -> float:
        first = self.costs[0] if stage == 0 else 0.0
        last = self.costs[-1] if stage == self.n_stages - 1 else 0.0
        return self.prefix[stop] - self.prefix[start] + first + last


def _cheapest_runs(stage_cost: _StageCost) -> Runs:
    """[start, stop) block ranges of `stage_cost.n_stages` consecutive stages whose largest
    cost is the smallest possible. As in torchtitan's rule, the first or the last stage may
    hold no block; a stage between them holds at least one.

    A stage's time is what paces a pipeline: the slowest stage sets every other stage's
    wait once per microbatch, so the split minimizes the largest stage, not the spread."""
    n_layers, n_stages = stage_cost.n_layers, stage_cost.n_stages
    if n_layers < n_stages - 2:
        raise TitanliteError(f"{FIELD}_degree: {n_stages} stages for a model of {n_layers} blocks: too many stages")
    # best[j]: the smallest largest-stage cost of stages 0..s covering blocks [0, j), with
    # cut[s][j] the start of stage s in that split (dynamic programming over stages).
    best = [stage_cost(0, 0, j) for j in range(n_layers + 1)]
    cuts: list[list[int]] = [[0] * (n_layers + 1)]
    for stage in range(1, n_stages):
        last = stage == n_stages - 1
        nxt, cut = [float("inf")] * (n_layers + 1), [0] * (n_layers + 1)
        for stop in [n_layers] if last else range(n_layers + 1):
            for start in range(stop + (1 if last else 0)):  # a middle stage holds a block; the last may hold none
                if (value := max(best[start], stage_cost(stage, start, stop))) < nxt[stop]:
                    nxt[stop], cut[stop] = value, start
        best = nxt
        cuts.append(cut)
    bounds = [n_layers]
    for stage in range(n_stages - 1, 0, -1):
        bounds.insert(0, cuts[stage][bounds[0]])
    return _between([0, *bounds])


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

    def matmul_flops(module: nn.Module) -> float:
        flops = 0.0
        for sub in module.modules():
            share = 1.0 if isinstance(sub, nn.Linear) else routed.get(sub, 0.0)  # of the tokens it computes
            flops += 6.0 * sum(p.numel() for p in sub.parameters()) * share
        return flops

    names = [name for name, _ in model.named_children()]
    at = names.index("layers")
    before = sum(matmul_flops(getattr(model, name)) for name in names[:at])
    after = sum(matmul_flops(getattr(model, name)) for name in names[at + 1 :])
    return [before, *(matmul_flops(block) + attention_per_block for block in model.layers.values()), after]


def _split_at(points: list[str], n_layers: int) -> Runs:
    """`layers.K` names: the first block of each stage after the first."""
    starts = []
    for point in points:
        prefix, _, number = point.partition(".")
        if prefix != "layers" or not number.isdigit() or not 0 < int(number) < n_layers:
            raise TitanliteError(f"{FIELD}_split_points: {point!r} is not a block layers.K with 0 < K < {n_layers}")
        starts.append(int(number))
    if starts != sorted(set(starts)):
        raise TitanliteError(f"{FIELD}_split_points: must increase, each named once (got {','.join(points)})")
    return _between([0, *starts, n_layers])


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
