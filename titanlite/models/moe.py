"""A mixture-of-experts feed-forward layer any model can use in place of its MLP:
token-choice top-k routing (group-limited as DeepSeek-V3's when asked), dropless grouped
experts (models/moe_experts.py), optional shared experts, and the two load-balancing methods in use, each optional:

- Qwen3-MoE's (Switch Transformer's) auxiliary loss: per layer,
  `coef * E * sum_i f_i * P_i`, f_i the fraction of the tokens routed to expert i (the
  f_i sum to top_k) and P_i expert i's mean router probability. Computed in a training
  forward and kept on the layer; the loop adds `aux_losses(model)` to its loss.
- DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for
  the top-k choice only (the weights stay the unbiased scores), moved after every
  optimizer step toward equal load by `update_expert_biases(model, group)`.

Each layer counts the tokens routed to each expert by its training forwards since the last
`update_expert_biases` (several forwards per step under gradient accumulation or a pipeline
schedule); `expert_load(model)` reads the balance for metrics. Under activation
checkpointing a layer's recompute counts its tokens again: every count of that layer
doubles, which changes neither the balance ratio nor the signs the bias rule reads. The
bias is a persistent buffer (saved in checkpoints: a resume routes as the run did), the
counts are not.

Routing runs in float32 (scores, top-k, weights) whatever the compute dtype, as DeepSeek-V3
and torchtitan do: near-equal bf16 scores would tie.

Training through a pipeline schedule, which owns the loss function, cannot add the aux loss
to the loss. `aux_loss_gradients(model, scale)` instead makes each layer hand its aux loss's
gradient to autograd itself (Megatron's MoEAuxLossAutoScaler): the layer's output passes
through unchanged, and its backward adds d(scale * aux_loss) to the router's gradients, as
if `scale * aux_loss` had been added to the loss. The trainer does this at every layout.

Under tensor parallelism the layer runs whole on every tp rank (the TP plan hands it the
whole sequence): its parameters are Replicate DTensors on the tp mesh, read as plain
tensors (`local_tensor`; models/moe_experts.py says why). Under context parallelism each
rank routes its own tokens and the per-sequence token counts of the aux loss are summed over the cp ranks
(`context_parallel`, set by the model like its attention's). Under expert parallelism
(`enable_expert_parallel`, parallel/expert_parallel.py) routing stays this rank's own, the
same as above, and only the routed rows travel to the ranks that hold their experts and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titanlite.models.decoder import FeedForward
from titanlite.models.init import ShardInit, unwrapped_name
from titanlite.models.moe_experts import ClampedSwiGLUExperts, GroupedExperts
from titanlite.parallel.collectives import sum_over
from titanlite.parallel.context_parallel import ContextParallel
from titanlite.parallel.expert_parallel import ExpertParallel
from titanlite.parallel.placement import local_tensor

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """Hyperparameters of a mixture-of-experts layer (HF Qwen3-MoE / DeepSeek-V3 names in
    brackets)."""

    n_experts: int = 8  # routed experts [num_experts, n_routed_experts]
    top_k: int = 2  # experts per token [num_experts_per_tok]
    hidden_dim: int = 256  # each routed expert's SwiGLU width [moe_intermediate_size]
    # Shared experts, run on every token and added to the routed output: one SwiGLU MLP of
    # width n_shared_experts * hidden_dim (DeepSeek-V3's form); 0: none [n_shared_experts].
    n_shared_experts: int = 0
    score_func: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    renormalize: bool = False  # the top-k weights divided by their sum [norm_topk_prob]
    route_scale: float = 1.0  # the routed output scaled by this [routed_scaling_factor]
    use_expert_bias: bool = False  # DeepSeek-V3's auxiliary-loss-free balancing
    bias_update_rate: float = 1e-3  # its bias step per update [bias_update_speed]
    aux_loss_coef: float = 0.0  # 0: no auxiliary loss [router_aux_loss_coef]
    # The aux loss of each sequence (f and P over its tokens), averaged over the sequences,
    # instead of one loss over all of a forward's tokens (transformers' Qwen3-MoE). Only
    # the per-sequence form is the same however a batch is split (data-parallel ranks,
    # gradient accumulation, pipeline microbatches), so every layout trains alike.
    aux_loss_per_sequence: bool = False
    # DeepSeek-V3's group-limited routing: the experts in n_group equal groups, each token
    # choosing its top_k among the topk_group groups whose two best scores sum highest
    # (DeepSeek-V3 keeps 4 of 8 groups: a token's experts on at most 4 nodes). 1: no groups.
    n_group: int = 1  # [n_group]
    topk_group: int = 1  # [topk_group]
    router_bias: bool = False  # the router's linear has a bias (gpt-oss) [router.bias]
    # gpt-oss's experts (moe_experts.ClampedSwiGLUExperts): (alpha, limit) of their clamped
    # SwiGLU, with biases, in HF's fused layout; None: the plain SwiGLU experts [swiglu_alpha, swiglu_limit].
    clamped_swiglu: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"MoEArgs.top_k must be in 1..n_experts ({self.n_experts}), got {self.top_k}")
        self._check_groups()
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEArgs.score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.hidden_dim <= 0 or self.n_shared_experts < 0 or self.aux_loss_coef < 0 or self.bias_update_rate < 0:
            raise ValueError(f"MoEArgs: sizes and rates must not be negative: {self}")

    def _check_groups(self) -> None:
        per_group = self.n_experts // self.n_group if self.n_group > 0 else 0
        if (
            self.n_group < 1
            or self.n_experts % self.n_group
            or not 1 <= self.topk_group <= self.n_group
            or self.top_k > self.topk_group * per_group
            or (self.n_group > 1 and per_group < 2)
        ):
            raise ValueError(
                f"MoEArgs: n_group ({self.n_group}) must divide n_experts ({self.n_experts}) into groups of 2 or"
                f" more experts, with topk_group ({self.topk_group}) in 1..n_group and top_k ({self.top_k}) at most"
                " topk_group * experts per group"
            )


@dataclass
class Routing:
    """Each token's top-k choice: `experts` [T, K] (int64) and their `weights` [T, K]
    (float32), with every expert's `scores` [T, E] (float32, unbiased)."""

    experts: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor


class Router(nn.Module):
    """Token-choice top-k: scores = softmax or sigmoid of gate(x); the top-k experts by
    score (+ the per-expert bias when given: it changes the choice, not the weights), among
    the best `topk_group` of `n_group` groups when there are groups; weights = the chosen
    scores, renormalized to sum to 1 if asked, times route_scale.

    Ties go the way `torch.topk` breaks them (on this device): the groups are ranked and
    masked with the same calls on the same float32 values as transformers'
    DeepseekV3TopkRouter, so the choice is its choice, ties included."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.n_experts, bias=args.router_bias)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None) -> Routing:
        bias = None if self.gate.bias is None else local_tensor(self.gate.bias)
        logits = F.linear(x, local_tensor(self.gate.weight), bias).float()
        scores = logits.softmax(dim=-1) if self.args.score_func == "softmax" else logits.sigmoid()
        choice = scores if expert_bias is None else scores + expert_bias
        if self.args.n_group > 1:
            choice = self._in_best_groups(choice)
        experts = choice.topk(self.args.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.args.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(experts, weights * self.args.route_scale, scores)

    def _in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` [T, E] with the experts outside each token's best `topk_group` groups
        set to -inf; a group's rank is the sum of its two best choice scores (DeepSeek-V3)."""
        groups = choice.view(choice.shape[0], self.args.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(self.args.topk_group, dim=-1, sorted=False).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choice)


def load_balancing_loss(
    scores: torch.Tensor, counts: torch.Tensor, args: MoEArgs, tokens: int | None = None
) -> torch.Tensor:
    """Switch Transformer's loss as Qwen3-MoE computes it, without the coefficient, from the
    router's `scores` [T, E] and the tokens each expert was given, `counts` [E]:
    E * sum_i f_i * P_i, f_i = counts_i / T (not differentiable), P_i = the mean over tokens
    of each token's scores normalized to sum to 1 (softmax scores already do; sigmoid ones
    are normalized as DeepSeek-V3's balance loss does). The gradient reaches the gate
    through P.

    Per sequence: `scores` [B, S, E] and `counts` [B, E] give each sequence's loss, and
    their mean. `tokens`: the tokens f counts over when they are more than `scores` holds
    (a sequence split over context-parallel ranks, whose counts were summed over them)."""
    fraction = counts.float() / (scores.shape[-2] if tokens is None else tokens)
    probs = scores if args.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return args.n_experts * (fraction * probs.mean(dim=-2)).sum(dim=-1).mean()


class _AuxLossGradient(torch.autograd.Function):
    """Returns `out` unchanged; in backward also gives `aux_loss` the gradient `scale`, as if
    `scale * aux_loss` had been added to the loss (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.like = scale, aux_loss.detach()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full_like(ctx.like, ctx.scale), None


class MoE(nn.Module):
    """x [..., dim] -> [..., dim]: each token's output is the weighted sum of its top-k
    routed experts' outputs (+ the shared experts' output).

    After a training forward, `aux_loss` holds this forward's auxiliary loss (None when
    `aux_loss_coef` is 0 or in eval), and `tokens_per_expert` has counted its routing.
    `aux_loss_scale` (set by `aux_loss_gradients`) makes the forward add the aux loss's
    gradient itself.
    """

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        if args.clamped_swiglu is None:
            self.experts = GroupedExperts(args.n_experts, dim, args.hidden_dim)
        else:
            self.experts = ClampedSwiGLUExperts(args.n_experts, dim, args.hidden_dim, *args.clamped_swiglu)
        # Llama's SwiGLU MLP (w1/w2/w3), so a TP plan shards it as it shards Llama's MLP.
        shared = args.n_shared_experts * args.hidden_dim
        self.shared_experts = FeedForward(dim, shared) if shared else None
        bias = torch.zeros(args.n_experts) if args.use_expert_bias else None
        self.register_buffer("expert_bias", bias, persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts, dtype=torch.int64), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.aux_loss_scale: float | None = None
        self.context_parallel: ContextParallel | None = None  # set by the model's enable_context_parallel
        self.expert_parallel: ExpertParallel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = self.router(flat, self.expert_bias)
        pairs = routing.experts.flatten()  # token t's k-th choice at t * top_k + k
        counts = torch.bincount(pairs, minlength=self.args.n_experts)
        order = pairs.argsort(stable=True)  # the pairs grouped by expert
        rows = flat[order // self.args.top_k]
        if self.expert_parallel is None:
            routed = self.experts(rows, counts)
        else:
            routed = self.expert_parallel.run(self.experts, rows, counts)
        # Back to (token, k) order by the inverse permutation (deterministic, unlike a
        # scatter-add), weighted in float32 and summed over k in a fixed order.
        unsorted = routed[order.argsort()].view(*routing.weights.shape, -1)
        wide = torch.promote_types(routed.dtype, torch.float32)
        out = (unsorted.to(wide) * routing.weights.unsqueeze(-1).to(wide)).sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        out = out.view(x.shape)
        self._record(routing, counts, x.shape)
        if self.aux_loss is not None and self.aux_loss_scale is not None:
            out = _AuxLossGradient.apply(out, self.aux_loss, self.aux_loss_scale)
        return out

    def enable_expert_parallel(self, expert_parallel: ExpertParallel) -> nn.Module:
        """Run the routed experts on the ranks of `expert_parallel` (each holding its share of
        them, laid out by the caller); returns the experts module."""
        self.expert_parallel = expert_parallel
        return self.experts

    def _record(self, routing: Routing, counts: torch.Tensor, shape: torch.Size) -> None:
        self.aux_loss = None
        if not self.training:
            return
        with torch.no_grad():
            self.tokens_per_expert += counts
        if self.args.aux_loss_coef > 0:
            self.aux_loss = self.args.aux_loss_coef * self._balance_loss(routing, counts, shape)

    def _balance_loss(self, routing: Routing, counts: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The aux loss over the whole batch, or per sequence of x [B, S, dim] (MoEArgs.
        aux_loss_per_sequence). Under context parallelism f counts the tokens of every cp
        rank (one all-reduce of [B, E] counts); P stays this rank's mean, which the
        gradient average over the cp ranks completes, as it does the cross-entropy."""
        n_experts, scores = self.args.n_experts, routing.scores
        sequences = shape[0] if self.args.aux_loss_per_sequence and len(shape) == 3 else 1
        if sequences > 1 or self.context_parallel is not None:
            owner = torch.arange(routing.experts.shape[0], device=scores.device) // (scores.shape[0] // sequences)
            slots = (owner.unsqueeze(-1) * n_experts + routing.experts).flatten()
            counts = torch.bincount(slots, minlength=sequences * n_experts).view(sequences, n_experts)
        tokens = scores.shape[0] // sequences
        if self.context_parallel is not None:
            counts = sum_over(self.context_parallel.mesh.get_group(), counts)
            tokens *= self.context_parallel.size
        return load_balancing_loss(scores.view(sequences, -1, n_experts), counts, self.args, tokens)

    @torch.no_grad()
    def init_weights(self, init: ShardInit, std: float) -> None:
        """Fill this rank's shard of every weight as in any other layout (models/init.py):
        the experts' input projections std 0.02, the gate and the other projections `std` (the
        block's depth-scaled output std, as torchtitan does); biases and counts zeroed."""
        init.trunc_normal(self.router.gate.weight, std=std)
        if self.router.gate.bias is not None:
            init.zeros(self.router.gate.bias)
        self.experts.init_weights(init, std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init, std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """Every MoE layer of `model` by its name (wrappers stripped), in module order."""
    return {unwrapped_name(name): module for name, module in model.named_modules() if isinstance(module, MoE)}


def aux_losses(model: nn.Module) -> torch.Tensor:
    """The sum of the auxiliary losses of the last training forward of every MoE layer
    (coefficients applied), to add to the loss before backward; 0 if there are none.
    Qwen3-MoE in transformers pools f and P over all layers before the product; this is the
    sum of per-layer losses (torchtitan's, Megatron's), the same for one layer."""
    losses = [layer.aux_loss for layer in moe_layers(model).values() if layer.aux_loss is not None]
    return torch.stack(losses).sum() if losses else torch.zeros(())


@contextlib.contextmanager
def aux_loss_gradients(model: nn.Module, scale: float) -> Iterator[None]:
    """Within this context every MoE layer of `model` adds its aux loss's gradient to the
    backward of its own output, as if `scale * aux_loss` were added to the loss: the way
    to train the aux loss through a pipeline schedule, whose loss function never sees the
    layers of other stages. `scale` is the weight the step gives this forward's loss (1 /
    microbatches). Do not add `aux_losses(model)` to the loss as well."""
    layers = list(moe_layers(model).values())
    for layer in layers:
        layer.aux_loss_scale = scale
    try:
        yield
    finally:
        for layer in layers:
            layer.aux_loss_scale = None


def token_counts(model: nn.Module) -> torch.Tensor:
    """Every layer's tokens per expert since the last update, in one tensor (a copy)."""
    layers = moe_layers(model).values()
    return torch.cat([layer.tokens_per_expert for layer in layers]) if layers else torch.zeros(0, dtype=torch.int64)


def discount_tokens(model: nn.Module, counts: torch.Tensor) -> None:
    """Take `counts` (a `token_counts` difference) back out of the layers' counts: for a
    forward that was not training (a pipeline stage's metadata forward, step/experts.py)."""
    layers = list(moe_layers(model).values())
    for layer, count in zip(layers, counts.split([layer.args.n_experts for layer in layers])):
        layer.tokens_per_expert -= count


def drop_expert_counts(model: nn.Module) -> None:
    """Zero every layer's token counts without moving a bias: after a step whose update was
    skipped (a non-finite loss or grad norm), whose routing should not steer the bias."""
    for layer in moe_layers(model).values():
        layer.tokens_per_expert.zero_()


def load_ratio(counts: torch.Tensor) -> float:
    """max / mean of the tokens per expert: 1.0 is perfect balance, E / top_k the worst
    (every token on the same top_k experts); nan when nothing was counted."""
    return float(counts.max() / counts.double().mean())


def expert_load(model: nn.Module) -> dict[str, float]:
    """Each MoE layer's `load_ratio` over this rank's tokens since the last update (no
    collective; `update_expert_biases` returns the same over all ranks)."""
    return {name: load_ratio(layer.tokens_per_expert) for name, layer in moe_layers(model).items()}


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Close a step's load count; call after every optimizer step. The counts are summed
    over `group` (the ranks that see different tokens: data parallel, and context parallel
    if any; None: this process alone), each expert bias moves by `bias_update_rate *
    sign(mean - count)` (DeepSeek-V3's rule: an overloaded expert's bias falls), then is
    centered (a shift of every bias changes no choice, and centered biases stay where
    float32 resolves small differences). The counts are zeroed, with or without a bias.
    Returns each layer's `load_ratio` over the group's tokens, for metrics."""
    layers = moe_layers(model)
    if not layers:
        return {}
    local = [layer.tokens_per_expert for layer in layers.values()]
    counts = sum_over(group, torch.cat(local)).split([len(c) for c in local])  # one all-reduce
    for layer, count in zip(layers.values(), counts):
        if layer.expert_bias is not None:
            step = layer.args.bias_update_rate * torch.sign(count.double().mean() - count)
            layer.expert_bias += (step - step.mean()).to(layer.expert_bias.dtype)
        layer.tokens_per_expert.zero_()
    return {name: load_ratio(count) for name, count in zip(layers, counts)}
