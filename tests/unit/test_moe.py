"""The mixture-of-experts layer (models/moe.py, models/moe_experts.py).

Outputs are checked against a reference computed token by token (each token's output = the
sum over its top-k experts of weight * expert(token), + the shared experts), in float64 so
that any difference is the layer's; group-limited routing against plain loops over groups
and experts that list every choice a tie allows, and against transformers' DeepSeek-V3
router; the auxiliary loss against transformers' own `load_balancing_loss_func`; the bias
balancing by measuring the load it leaves; the init of a sharded layer against DTensor's
slicing of the whole layer's weights.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from tests.helpers.small_nets import one_rank_group
from titanlite.models.init import ShardInit
from titanlite.models.moe import MoE, MoEArgs, Router, aux_losses, expert_load, load_ratio, update_expert_biases
from titanlite.models.moe_experts import run_experts_grouped, run_experts_loop, use_grouped_mm

DIM, SEED = 16, 3


def make_moe(args: MoEArgs, dtype: torch.dtype = torch.float64) -> MoE:
    torch.manual_seed(SEED)
    moe = MoE(DIM, args)
    moe.init_weights(ShardInit(moe, SEED), std=0.3)  # large enough that experts differ clearly
    return moe.to(dtype)


def tokens(n: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    """[n, DIM] inputs whose feature 0 is always 1, so a gate column 0 biases experts."""
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    x[:, 0] = 1.0
    return x


def swiglu(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return w2 @ (F.silu(w1 @ v) * (w3 @ v))


def best(candidates: list[int], value, k: int) -> list[tuple[int, ...]]:
    """Every k of `candidates` that a top-k by `value` may pick: none of those left out is
    above one picked (several when values tie at the cut)."""
    return [
        pick
        for pick in itertools.combinations(candidates, k)
        if min(value(c) for c in pick) >= max((value(c) for c in candidates if c not in pick), default=-math.inf)
    ]


def allowed_choices(args: MoEArgs, choice: torch.Tensor) -> set[tuple[int, ...]]:
    """One token's expert sets (sorted) that group-limited routing may pick from its float32
    choice scores [E]: a group's score is the (float32) sum of its two best, the topk_group
    best groups are kept, then the top_k best experts among theirs."""
    per_group = args.n_experts // args.n_group
    members = [list(range(g * per_group, (g + 1) * per_group)) for g in range(args.n_group)]
    group_score = []
    for experts in members:
        first, second = sorted((choice[e] for e in experts), key=float, reverse=True)[:2]
        group_score.append(float(first + second))
    picks = set()
    for groups in best(list(range(args.n_group)), lambda g: group_score[g], args.topk_group):
        candidates = [e for g in groups for e in members[g]]
        picks |= {tuple(sorted(p)) for p in best(candidates, lambda e: float(choice[e]), args.top_k)}
    return picks


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: scores, its top-k by score + bias (in its best groups if any),
    weights from the scores."""
    args, rows = moe.args, []
    for v in x:
        logits = (moe.router.gate.weight @ v).float()
        scores = logits.softmax(-1) if args.score_func == "softmax" else logits.sigmoid()
        choice = (scores if moe.expert_bias is None else scores + moe.expert_bias.float()).detach()
        if args.n_group == 1:
            top = sorted(range(args.n_experts), key=lambda e: -float(choice[e]))[: args.top_k]
        else:
            (top,) = allowed_choices(args, choice)  # no ties in these inputs
            top = list(top)
        weights = scores[top] / (scores[top].sum() if args.renormalize else 1.0) * args.route_scale
        experts = moe.experts
        out = sum(w * swiglu(experts.w1[e], experts.w2[e], experts.w3[e], v) for w, e in zip(weights, top))
        if moe.shared_experts is not None:
            shared = moe.shared_experts
            out = out + swiglu(shared.w1.weight, shared.w2.weight, shared.w3.weight, v)
        rows.append(out)
    return torch.stack(rows)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Routing weights are float32 (as in training), everything else float64.
    return torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "args",
    [
        MoEArgs(n_experts=6, top_k=2, hidden_dim=8, score_func="softmax", renormalize=False),
        MoEArgs(n_experts=6, top_k=2, hidden_dim=8, score_func="softmax", renormalize=True, n_shared_experts=2),
        MoEArgs(n_experts=6, top_k=3, hidden_dim=8, score_func="sigmoid", renormalize=False, route_scale=2.5),
        MoEArgs(
            n_experts=6,
            top_k=3,
            hidden_dim=8,
            score_func="sigmoid",
            renormalize=True,
            use_expert_bias=True,
            n_shared_experts=1,
        ),
        MoEArgs(
            n_experts=6,
            top_k=3,
            hidden_dim=8,
            score_func="sigmoid",
            renormalize=True,
            route_scale=2.5,
            use_expert_bias=True,
            n_shared_experts=1,
            n_group=3,
            topk_group=2,
        ),
    ],
    ids=["softmax", "softmax_renorm_shared", "sigmoid_scaled", "sigmoid_renorm_bias_shared", "sigmoid_groups"],
)
def test_each_token_is_the_weighted_sum_of_its_top_k_experts(args):
    moe = make_moe(args)
    if moe.expert_bias is not None:  # a bias that changes choices but not weights
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.25, -0.1, 0.05]))
    x = tokens(40).view(4, 10, DIM)
    out = moe(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert close(out.view(40, DIM), reference(moe, x.view(40, DIM)))


@torch.no_grad()
def test_an_idle_expert_and_an_expert_taking_every_token_dropless():
    """Expert 0 gets every token (far past any capacity factor: 48 where 1.25 T k / E = 30),
    expert 3 none; every token is still computed exactly."""
    moe = make_moe(MoEArgs(n_experts=4, top_k=2, hidden_dim=8))
    moe.router.gate.weight[0, 0] = 50.0
    moe.router.gate.weight[3, 0] = -50.0
    x = tokens(48)
    out = moe(x)
    assert moe.tokens_per_expert[0] == 48 and moe.tokens_per_expert[3] == 0 and moe.tokens_per_expert.sum() == 96
    assert close(out, reference(moe, x))


def test_counts_add_up_over_training_forwards_only():
    moe = make_moe(MoEArgs(n_experts=4, top_k=2, hidden_dim=8))
    x = tokens(30)
    moe(x)
    first = moe.tokens_per_expert.clone()
    picks = moe.router(x).experts.flatten()
    assert torch.equal(first, torch.bincount(picks, minlength=4)) and first.sum() == 60
    moe(x)
    assert torch.equal(moe.tokens_per_expert, 2 * first)
    moe.eval()
    moe(x)
    assert torch.equal(moe.tokens_per_expert, 2 * first) and moe.aux_loss is None
    assert expert_load(moe) == {"": pytest.approx(load_ratio(first))}


def test_bias_balancing_moves_a_skewed_router_toward_uniform_load():
    """Experts 0 and 1 start with nearly every token (max/mean load near E / k = 4); bias
    updates after each step on the same inputs bring the measured load near 1, where the
    sign rule then keeps it oscillating by about one bias step."""
    args = MoEArgs(
        n_experts=8, top_k=2, hidden_dim=8, score_func="sigmoid", use_expert_bias=True, bias_update_rate=0.01
    )
    moe = make_moe(args, torch.float32)
    with torch.no_grad():
        moe.router.gate.weight[:2, 0] += 4.0
    x = tokens(256, torch.float32)
    ratios = []
    for _ in range(50):
        with torch.no_grad():
            moe(x)
        ratios.append(update_expert_biases(moe)[""])
    assert ratios[0] > 3.5 and ratios[10] < ratios[0] - 1
    assert min(ratios[-10:]) < 1.15 and max(ratios[-10:]) < 1.4, ratios
    assert moe.expert_bias[:2].max() < moe.expert_bias[2:].min()  # the overloaded ones fell
    assert float(moe.expert_bias.sum()) == pytest.approx(0.0, abs=1e-5)  # centered


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_is_transformers_qwen3_moe_loss_and_reaches_the_gate(top_k):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    coef, n_experts = 0.01, 8
    moe = make_moe(MoEArgs(n_experts=n_experts, top_k=top_k, hidden_dim=8, aux_loss_coef=coef), torch.float32)
    x = tokens(2 * 12, torch.float32).view(2, 12, DIM)  # a batch of 2 sequences
    moe(x)
    ours = aux_losses(moe)
    logits = moe.router.gate(x.view(-1, DIM))
    theirs = coef * load_balancing_loss_func((logits,), n_experts, top_k)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    (ours_grad,) = torch.autograd.grad(ours, moe.router.gate.weight)
    (their_grad,) = torch.autograd.grad(theirs, moe.router.gate.weight)
    assert ours_grad.abs().max() > 0 and torch.allclose(ours_grad, their_grad, rtol=1e-5, atol=1e-9)


def test_no_aux_loss_without_a_coefficient_and_zero_without_layers():
    moe = make_moe(MoEArgs(n_experts=4, top_k=2, hidden_dim=8))
    moe(tokens(10))
    assert moe.aux_loss is None and float(aux_losses(moe)) == 0.0
    assert float(aux_losses(nn.Linear(2, 2))) == 0.0


def grouped_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    w1, w3 = (torch.randn(4, 24, DIM, generator=g).to(dtype).requires_grad_() for _ in range(2))
    w2 = torch.randn(4, DIM, 24, generator=g).to(dtype).requires_grad_()
    x = torch.randn(16, DIM, generator=g).to(dtype).requires_grad_()
    return w1, w2, w3, x


def test_grouped_matmul_is_chosen_only_for_bf16_on_cuda():
    cpu = torch.device("cpu")
    assert not any(use_grouped_mm(cpu, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16))
    assert not use_grouped_mm(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 16, 0, 0]], ids=["idle_expert", "one_expert"])
def test_grouped_matmul_and_the_expert_loop_agree(dtype, counts):
    """torch 2.13's grouped matmul runs on CPU in float32 and bfloat16 (not float64), so both
    paths compare here: the same values and gradients, to rounding (seen: float32 2e-8
    relative apart with several groups, bit-equal with one; bfloat16 bit-equal)."""
    results = []
    for run in (run_experts_grouped, run_experts_loop):
        inputs = grouped_inputs(dtype)
        out = run(*inputs, torch.tensor(counts))
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(dtype))  # a dense gradient
        results.append([out.detach(), *(t.grad for t in inputs)])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for grouped, loop in zip(*results):
        assert torch.allclose(grouped, loop, rtol=tolerance, atol=tolerance * float(loop.abs().max()))


def test_the_expert_loop_hands_each_stacked_weight_one_gradient_not_one_per_expert():
    """Each autograd node that feeds a weight's gradient builds a gradient of the whole stack
    [E, ...]: one per expert (indexing w[e]) makes the backward E^2 work, 20x the step of
    torchtitan's 64-expert debug flavor on CPU; one in all (unbind) keeps it E."""
    inputs = grouped_inputs(torch.float32)
    out = run_experts_loop(*inputs, torch.tensor([5, 0, 9, 2]))
    feeding = {id(w): 0 for w in inputs[:3]}
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and id(getattr(child, "variable", None)) in feeding:
                feeding[id(child.variable)] += 1
            todo.append(child)
    assert list(feeding.values()) == [1, 1, 1]


def test_bias_update_sums_counts_over_the_group_and_the_bias_is_checkpointed(monkeypatch):
    biased = MoEArgs(n_experts=4, top_k=2, hidden_dim=8, use_expert_bias=True, bias_update_rate=0.1)
    model = nn.ModuleDict({"0": make_moe(biased), "1": make_moe(MoEArgs(n_experts=4, top_k=2, hidden_dim=8))})
    assert "0.expert_bias" in model.state_dict() and "1.expert_bias" not in model.state_dict()
    assert not any("tokens_per_expert" in key for key in model.state_dict())
    model["0"].tokens_per_expert.copy_(torch.tensor([10, 0, 2, 4]))  # mean 4
    model["1"].tokens_per_expert.copy_(torch.tensor([3, 3, 3, 3]))
    with one_rank_group(monkeypatch):
        ratios = update_expert_biases(model, dist.group.WORLD)
    assert ratios == {"0": pytest.approx(2.5), "1": pytest.approx(1.0)}
    step = 0.1 * torch.tensor([-1.0, 1.0, 1.0, 0.0])
    assert torch.allclose(model["0"].expert_bias, (step - step.mean()).double())
    assert all(int(layer.tokens_per_expert.sum()) == 0 for layer in model.values())
    assert torch.equal(model.state_dict()["0.expert_bias"], model["0"].expert_bias)


def test_init_is_the_same_whole_and_as_fsdp_shards():
    """Rank 2 of 4 (a fake process group: collectives are no-ops, shards are real) holds
    exactly DTensor's slice of the single-process weights; 6 experts split 2/2/2/0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    args = MoEArgs(n_experts=6, top_k=2, hidden_dim=10, n_shared_experts=1, use_expert_bias=True)
    whole = MoE(DIM, args)
    whole.init_weights(ShardInit(whole, SEED), std=0.02)
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (4,), mesh_dim_names=("moe_test_dp",))
        with torch.device("meta"):
            sharded = MoE(DIM, args)
        fully_shard(sharded.experts, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        sharded.to_empty(device="cpu")
        sharded.init_weights(ShardInit(sharded, SEED), std=0.02)
        reference = dict(whole.named_parameters())
        for name, param in sharded.named_parameters():
            expected = distribute_tensor(reference[name].detach(), mesh, param.placements, src_data_rank=None)
            assert torch.equal(param.to_local(), expected.to_local()), name
        assert torch.equal(sharded.expert_bias, torch.zeros(6)) and int(sharded.tokens_per_expert.sum()) == 0
    finally:
        dist.destroy_process_group()
    w1 = reference["experts.w1"]
    assert float(w1.detach().std()) == pytest.approx(0.02, rel=0.1) and not torch.equal(w1[0], w1[1])


GROUPS = MoEArgs(
    n_experts=8,
    top_k=3,
    hidden_dim=8,
    score_func="sigmoid",
    renormalize=True,
    route_scale=2.5,
    use_expert_bias=True,
    n_group=4,
    topk_group=2,
)


def group_router(weight: torch.Tensor, bias: torch.Tensor, args: MoEArgs = GROUPS) -> Router:
    router = Router(DIM, args)
    router.gate.weight.data.copy_(weight)
    return router


def test_group_limited_routing_never_picks_outside_the_best_groups():
    """Random float32 scores (no ties): each token's choice is the one the loops allow. Group
    3 holds the best expert by far (6, bias +0.9) and the worst (7, bias -2): its group score
    (< 1.9 - 1) is below every other group's (> 0.5 + 0.5), so it is never chosen, though a
    plain top-k would often take expert 6."""
    torch.manual_seed(SEED)
    weight, bias = torch.randn(8, DIM), torch.tensor([0.5, 0.5, 0.5, 0.55, 0.45, 0.5, 0.9, -2.0])
    x = tokens(64, torch.float32)
    routing = group_router(weight, bias)(x, bias)
    for t, v in enumerate(x):
        choice = (weight @ v).sigmoid() + bias
        (expected,) = allowed_choices(GROUPS, choice)
        assert tuple(sorted(routing.experts[t].tolist())) == expected
        scores = (weight @ v).sigmoid()[list(expected)]
        weights = dict(zip(expected, (scores / scores.sum() * 2.5).tolist()))
        assert routing.weights[t].tolist() == pytest.approx([weights[e] for e in routing.experts[t].tolist()], rel=1e-6)
    counts = torch.bincount(routing.experts.flatten(), minlength=8)
    assert counts[6] == counts[7] == 0 and bool((counts[:6] > 0).all())
    plain = ((x @ weight.T).sigmoid() + bias).topk(3, dim=-1).indices
    assert bool((plain == 6).any())


def test_group_limited_ties_break_as_transformers_router():
    """Gate rows repeated so that experts and whole groups tie exactly: the choice is one the
    loops allow for a tie, and the same experts and weights as transformers'
    DeepseekV3TopkRouter on the same float32 inputs (both break ties by torch.topk)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(SEED)
    a, b, c = torch.randn(3, DIM)
    weight = torch.stack([a, b, a, b, c, c, b, -a])  # groups 0 and 1 tie; group 2's experts tie
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0])
    config = DeepseekV3Config(
        hidden_size=DIM,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    hf = DeepseekV3TopkRouter(config)
    hf.weight.data.copy_(weight)
    hf.e_score_correction_bias.copy_(bias)
    _, hf_weights, hf_experts = hf(tokens(64, torch.float32))
    x = tokens(64, torch.float32)
    routing = group_router(weight, bias)(x, bias)
    tied = 0
    for t, v in enumerate(x):
        allowed = allowed_choices(GROUPS, (weight @ v).sigmoid() + bias)
        tied += len(allowed) > 1
        ours = dict(zip(routing.experts[t].tolist(), routing.weights[t].tolist()))
        theirs = dict(zip(hf_experts[t].tolist(), hf_weights[t].tolist()))
        assert tuple(sorted(ours)) in allowed and sorted(ours) == sorted(theirs)
        assert [ours[e] for e in sorted(ours)] == pytest.approx([theirs[e] for e in sorted(ours)], rel=1e-6)
    assert tied > 0


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_one_group_routes_as_plain_top_k(score_func):
    """n_group 1 is the plain top-k of before groups existed, bit for bit."""
    args = MoEArgs(n_experts=8, top_k=3, score_func=score_func, renormalize=True, route_scale=2.0)
    torch.manual_seed(SEED)
    weight, bias = torch.randn(8, DIM), torch.randn(8) * 0.1
    x = tokens(32, torch.float32)
    routing = group_router(weight, bias, args)(x, bias)
    logits = x @ weight.T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    experts = (scores + bias).topk(3, dim=-1).indices
    weights = scores.gather(-1, experts)
    assert torch.equal(routing.experts, experts)
    assert torch.equal(routing.weights, weights / (weights.sum(-1, keepdim=True) + 1e-20) * 2.0)


def test_args_are_checked():
    bad_args = (
        {"top_k": 9},
        {"top_k": 0},
        {"score_func": "relu"},
        {"n_shared_experts": -1},
        {"n_group": 3},
        {"n_group": 0},
        {"n_group": 8},
        {"n_group": 4, "topk_group": 0},
        {"n_group": 4, "topk_group": 5},
        {"n_group": 4, "topk_group": 1, "top_k": 3},
    )
    for bad in bad_args:
        with pytest.raises(ValueError, match="MoEArgs"):
            MoEArgs(n_experts=8, **bad)
    assert math.isnan(load_ratio(torch.zeros(4, dtype=torch.int64)))
