"""titanlite/parallel/pipeline.py and pipeline_plan.py on one process: the stage plan and its refusals, the split
(names kept, other stages' modules gone), the parts seen as one module, and the estimate of
the microbatches a schedule holds (parallel/estimate.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from titanlite.errors import TitanliteError
from titanlite.models import get_model_spec
from titanlite.models.moe import moe_layers
from titanlite.parallel.estimate import in_flight_microbatches
from titanlite.parallel.pipeline import ModelParts, shared_parameters, split_stage
from titanlite.parallel.pipeline_plan import _cheapest_runs, _StageCost, part_flops, plan_layout


def parallelism(degree=2, schedule="1F1B", microbatch=1, per_stage=None, split=(), first=1, last=1, balance="layers"):
    return SimpleNamespace(
        pipeline_parallel_degree=degree,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_microbatch_size=microbatch,
        pipeline_parallel_layers_per_stage=per_stage,
        pipeline_parallel_split_points=list(split),
        pipeline_parallel_first_stage_less_layers=first,
        pipeline_parallel_last_stage_less_layers=last,
        pipeline_parallel_balance=balance,
    )


def blocks(layout) -> list[list[int]]:
    return [[int(b) for b in stage.blocks] for stage in layout.stages]


def test_the_automatic_split_counts_the_embedding_and_the_output_as_a_block_each():
    two = plan_layout(parallelism(), 6, 8)
    assert blocks(two) == [[0, 1, 2], [3, 4, 5]]
    assert (two.stages[0].first, two.stages[0].last, two.stages[1].first, two.stages[1].last) == (
        True,
        False,
        False,
        True,
    )
    assert blocks(plan_layout(parallelism(schedule="Interleaved1F1B"), 6, 8)) == [[0], [1, 2], [3, 4], [5]]
    # 32 blocks on 4 stages: 34 slots of 8 or 9; the first and last stage give one to the embedding and the head.
    assert [len(s) for s in blocks(plan_layout(parallelism(degree=4), 32, 8))] == [8, 9, 8, 7]
    assert blocks(plan_layout(parallelism(first=0, last=0), 6, 8)) == [[0, 1, 2], [3, 4, 5]]
    assert blocks(plan_layout(parallelism(first=2, last=0), 6, 8)) == [[0, 1], [2, 3, 4, 5]]


def test_tail_blocks_sit_on_the_last_stage_whatever_the_split():
    """Multi-token prediction's blocks run after the output: the last stage holds them, also
    when the split of the other blocks leaves it none (a V schedule's four stages of 4 blocks)."""
    assert blocks(plan_layout(parallelism(), 6, 8, tail_blocks=2)) == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert blocks(plan_layout(parallelism(schedule="ZBVZeroBubble"), 4, 8, tail_blocks=1))[-1][-1] == 4


def test_the_split_by_flops_makes_the_slowest_stage_the_cheapest_possible():
    """Against every split of a few blocks (a middle stage holds a block; the first and last
    may hold none): the largest stage cost is the smallest any split reaches."""
    import itertools
    import random

    assert _cheapest_runs(_StageCost([0.0, 1, 1, 1, 1, 1, 1, 1.2], 2)) == [
        (0, 4),
        (4, 6),
    ]  # 4 | 2 + a head of 1.2 blocks
    assert _cheapest_runs(_StageCost([0.0, 1, 1, 1, 1, 1, 1, 0.5], 2)) == [(0, 3), (3, 6)]
    assert _cheapest_runs(_StageCost([0.0, 1, 1, 4.0], 3)) == [
        (0, 1),
        (1, 2),
        (2, 2),
    ]  # the head alone on the last stage
    rng = random.Random(0)
    for _ in range(200):
        n_layers, n_stages = rng.randint(1, 7), rng.randint(1, 4)
        if n_stages > 2 and n_layers < n_stages - 2:
            continue
        costs = [rng.uniform(0, 3) for _ in range(n_layers + 2)]

        def largest(runs):
            last = len(runs) - 1
            return max(
                sum(costs[1 + a : 1 + b]) + (costs[0] if i == 0 else 0) + (costs[-1] if i == last else 0)
                for i, (a, b) in enumerate(runs)
            )

        splits = []
        for cuts in itertools.combinations_with_replacement(range(n_layers + 1), n_stages - 1):
            bounds = [0, *cuts, n_layers]
            runs = list(zip(bounds, bounds[1:]))
            if all(b > a for a, b in runs[1:-1]):
                splits.append(runs)
        got = _cheapest_runs(_StageCost(costs, n_stages))
        assert got in splits and largest(got) == pytest.approx(min(largest(r) for r in splits))


def test_part_flops_count_what_the_model_spec_counts_and_balance_the_debug_model():
    """The parts' FLOPs sum to the spec's FLOPs per token (less the norms' weights, which do no
    matmul); an MoE block counts its routed experts at top_k / n_experts. The debug model's
    head is ~1.1 blocks at seq 256, so the split puts 4 blocks before it, and 3 at seq 2048,
    where attention makes the blocks heavier."""
    for name, flavor in (("llama3", "debugmodel"), ("qwen3", "debugmodel_moe"), ("gpt2", "debugmodel")):
        spec = get_model_spec(name, flavor)
        args = spec.args_for(flavor, 4096)
        with torch.device("meta"):
            model = spec.model_class(args)
        n_params = sum(p.numel() for p in model.parameters())
        attention = (spec.flops_per_token(args, 0, 512) - spec.flops_per_token(args, 0, 0)) / len(model.layers)
        routed = {layer.experts: layer.args.top_k / layer.args.n_experts for layer in moe_layers(model).values()}
        parts = part_flops(model, attention, routed)
        assert parts[0] == 0.0 and sum(parts) == pytest.approx(spec.flops_per_token(args, n_params, 512), rel=2e-3)
    spec = get_model_spec("llama3", "debugmodel")
    with torch.device("meta"):
        model = spec.model_class(spec.args_for("debugmodel", 4096))
    for seq, want in ((256, [[0, 1, 2, 3], [4, 5]]), (2048, [[0, 1, 2], [3, 4, 5]])):
        attention = (spec.flops_per_token(model.args, 0, seq) - spec.flops_per_token(model.args, 0, 0)) / 6
        layout = plan_layout(parallelism(balance="flops"), 6, 8, part_flops(model, attention))
        assert blocks(layout) == want
    assert (
        layout.stages[1].describe().startswith("stage 1: layers 3-5 + output (")
        and "MFLOP/token" in layout.stages[1].describe()
    )
    with pytest.raises(TitanliteError, match="^parallelism.pipeline_parallel_split_points: set together with"):
        plan_layout(parallelism(balance="flops", split=["layers.2"]), 6, 8, part_flops(model, 0.0))


def test_a_stage_may_hold_only_the_embedding_or_the_head():
    layout = plan_layout(parallelism(schedule="Interleaved1F1B"), 4, 8)  # 6 slots over 4 stages
    assert blocks(layout) == [[0], [1, 2], [3], []]
    assert layout.stages[-1].describe() == "stage 3: output"


def test_layers_per_stage_and_split_points_choose_the_stages():
    assert blocks(plan_layout(parallelism(schedule="LoopedBFS", per_stage=2), 6, 8)) == [[0], [1, 2], [3, 4], [5]]
    assert blocks(plan_layout(parallelism(split=["layers.4"]), 6, 8)) == [[0, 1, 2, 3], [4, 5]]


def test_stages_sit_round_robin_or_in_a_v():
    looped = plan_layout(parallelism(schedule="Interleaved1F1B"), 6, 8)
    assert [looped.stage_indices(r) for r in (0, 1)] == [(0, 2), (1, 3)] and looped.last_stage_pp_rank() == 1
    v = plan_layout(parallelism(schedule="ZBVZeroBubble"), 6, 8)
    assert [v.stage_indices(r) for r in (0, 1)] == [(0, 3), (1, 2)] and v.last_stage_pp_rank() == 0
    single = plan_layout(parallelism(degree=4), 8, 8)
    assert [single.stage_indices(r) for r in range(4)] == [(0,), (1,), (2,), (3,)] and single.n_microbatches == 8


@pytest.mark.parametrize(
    "settings, n_layers, batch, message",
    [
        (parallelism(degree=9), 6, 9, "9 stages for a model of 6 blocks"),
        (parallelism(schedule="ZBVZeroBubble", per_stage=1), 6, 8, "ZBVZeroBubble runs exactly 2 stages per rank"),
        (parallelism(per_stage=2), 6, 8, "1F1B runs exactly 1 stage per rank"),
        (parallelism(schedule="Interleaved1F1B", per_stage=4), 6, 8, "Interleaved1F1B runs at least 2 stages per rank"),
        (parallelism(split=["layers.2", "layers.4"]), 6, 8, "3 stages do not divide over 2 pipeline ranks"),
        (parallelism(split=["layers.0"]), 6, 8, "'layers.0' is not a block"),
        (parallelism(split=["layers.4", "layers.2", "layers.1"], degree=4), 6, 8, "must increase"),
        (parallelism(microbatch=3), 6, 8, "3 does not divide training.local_batch_size 8"),
        (parallelism(), 6, 1, "1F1B needs at least one microbatch per stage (2)"),
        (parallelism(schedule="DualPipeV"), 6, 2, "DualPipeV needs at least one microbatch per stage (4)"),
        (parallelism(degree=4, schedule="Interleaved1F1B"), 16, 9, "needs 9 microbatches to split evenly into them"),
        (
            parallelism(degree=4, first=4),
            6,
            8,
            "pipeline_parallel_first_stage_less_layers: 4 is more than the first stage's share of 3",
        ),
    ],
)
def test_impossible_layouts_are_one_line_naming_the_key(settings, n_layers, batch, message):
    with pytest.raises(TitanliteError, match="parallelism.pipeline_parallel") as error:
        plan_layout(settings, n_layers, batch)
    assert message in str(error.value)


def meta_llama(flavor="debugmodel"):
    spec = get_model_spec("llama3", flavor)
    with torch.device("meta"):
        return spec.model_class(spec.args_for(flavor, 128))


def test_a_stage_is_the_model_without_the_other_stages_and_keeps_every_name():
    model = meta_llama()
    layout = plan_layout(parallelism(schedule="ZBVZeroBubble"), 6, 8)
    first, last = (split_stage(model, layout.stages[i]) for i in (0, 3))
    assert first.norm is None and first.output is None and list(first.layers) == ["0"]
    assert last.tok_embeddings is None and list(last.layers) == ["5"]
    whole = dict(model.named_parameters())
    for part in (first, last):
        for name, param in part.named_parameters():
            assert name in whole and param.shape == whole[name].shape
    parts = ModelParts([first, last])  # rank 0 of the V holds stages 0 and 3
    assert sorted(n for n, _ in parts.named_parameters()) == sorted(
        n for n, _ in [*first.named_parameters(), *last.named_parameters()]
    )
    assert all(not n.startswith("parts") for n, _ in parts.named_parameters())
    parts.eval()
    assert not first.training and not last.training and not first.layers["0"].training


def test_tied_embeddings_are_found_as_shared_between_children():
    assert shared_parameters(meta_llama("debugmodel")) == []
    assert shared_parameters(meta_llama("debugmodel_tied")) == ["tok_embeddings and output"]


def test_a_stage_runs_through_the_models_own_forward():
    torch.manual_seed(0)
    spec = get_model_spec("llama3", "debugmodel")
    model = spec.model_class(spec.args_for("debugmodel", 128))
    model.init_weights(seed=1)
    layout = plan_layout(parallelism(), 6, 8)
    first, last = (split_stage(model, stage) for stage in layout.stages)
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(last(first(tokens)), model(tokens))


@pytest.mark.parametrize(
    "schedule, rank, expected",
    [
        ("GPipe", 0, 8),
        ("LoopedBFS", 1, 8),
        ("1F1B", 0, 4),
        ("1F1B", 3, 1),
        ("ZBVZeroBubble", 2, 4),
        ("DualPipeV", 0, 4),
        ("Interleaved1F1B", 0, 6),
        ("Interleaved1F1B", 3, 3),
    ],
)
def test_microbatches_in_flight_follow_the_schedule(schedule, rank, expected):
    assert in_flight_microbatches(schedule, degree=4, n_microbatches=8, stages_per_rank=2, pp_rank=rank) == expected
    assert in_flight_microbatches(schedule, degree=4, n_microbatches=1, stages_per_rank=2, pp_rank=rank) == 1
