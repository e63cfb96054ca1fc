"""Cross-entropy over whole or vocab-sharded logits, in float32 (float64 logits in float64), in a few passes.

`F.cross_entropy` writes log_softmax(logits) ([tokens, vocab]), and its backward zero-fills a
gradient of the same size, scatters into it and reads both again; under DTensor's
`loss_parallel()` the same is decomposed into about ten passes over each rank's vocab shard,
with two exp() calls. Here forward takes one max, the exponentials (kept for backward) and
their sum, and picks the target logits; only [tokens]-sized vectors cross ranks (two
all-reduces); backward scales the kept exponentials in place into softmax - onehot.

The loss is the mean over tokens, as `F.cross_entropy`'s default, when every label is a real
token (pretraining data). Over chat data the loader marks the labels not trained with a negative
id (`data/loader.IGNORE`, transformers' -100): given `tokens`, the loss is the sum over the other
labels divided by `tokens`, which the step takes from the whole step's count (`LabelCount`), so
every layout divides by what one process would. Vocab-sharded logits are the DTensor the
TP plan's output head leaves with loss parallel (`Shard(-1)` on the tp mesh): the logits are
never gathered, and the result is a plain tensor, equal on every tp rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from titanlite.parallel.collectives import mean_over


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of local logits [tokens, vocab shard] whose shard starts at `vocab_start`;
    with `tokens`, the sum over labels >= 0 divided by it."""

    @staticmethod
    def forward(ctx, logits, labels: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None, tokens=None):
        logits32 = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32, or float64 kept
        maxes = logits32.amax(dim=-1)
        if group is not None:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        exps = (logits32 - maxes[:, None]).exp_()
        local_labels = labels - vocab_start
        here = (local_labels >= 0) & (local_labels < logits.shape[-1])
        index = local_labels.clamp(0, logits.shape[-1] - 1)[:, None]
        sums = torch.stack((exps.sum(dim=-1), logits32.gather(1, index).squeeze(1) * here))  # [2, tokens]
        if group is not None:
            dist.all_reduce(sums, group=group)
        sum_exp, target_logits = sums
        weights = None if tokens is None else (labels >= 0) / tokens  # each token's share of the loss
        ctx.save_for_backward(exps, sum_exp, index, here, weights)
        ctx.logits_dtype = logits.dtype
        losses = sum_exp.log() + maxes - target_logits
        return losses.mean() if weights is None else (losses * weights).sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """softmax - onehot, times grad / tokens, written into the kept exponentials (a second
        backward through the same graph fails loudly on their version counter)."""
        exps, sum_exp, index, here, weights = ctx.saved_tensors
        scale = grad_output / exps.shape[0] if weights is None else grad_output * weights
        grad = exps.mul_((scale / sum_exp)[:, None])
        grad.scatter_add_(1, index, (-scale * here)[:, None].to(grad.dtype))
        return grad.to(ctx.logits_dtype), None, None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits [batch, seq, vocab] (plain, or a vocab-sharded DTensor)
    against labels [batch, seq]; a float32 scalar. `tokens`: the sum over the labels >= 0
    divided by it instead (labels masked as `data/loader.IGNORE`)."""
    labels = labels.flatten()
    if not isinstance(logits, DTensor):
        return _CrossEntropy.apply(logits.flatten(0, 1), labels, 0, None, tokens)
    placement = logits.placements[0]
    if logits.device_mesh.ndim != 1 or not (
        isinstance(placement, Shard) and placement.dim % logits.ndim == logits.ndim - 1
    ):
        raise ValueError(
            f"cross_entropy: expected logits sharded on the vocab over one mesh dim, got {logits.placements}"
        )
    mesh = logits.device_mesh
    local = logits.to_local()
    start = mesh.get_local_rank() * local.shape[-1]  # the TP plan checks vocab % tp == 0: even shards
    return _CrossEntropy.apply(local.flatten(0, 1), labels, start, mesh.get_group(), tokens)


class LabelCount:
    """The divisor of each loss a rank computes in a step over masked labels: the step's labels
    that are trained, over every rank that holds different tokens (dp x cp, `group`), per rank
    and per loss computed (an accumulated microbatch, a pipeline microbatch). Each rank's loss
    is then its trained tokens' sum times ranks / all trained tokens, whose average over the
    ranks (the reported loss, FSDP's gradient) is one process's mean over the step's trained
    tokens, whatever the layout and however they fall on the ranks."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, labels: list[torch.Tensor], losses: int) -> torch.Tensor:
        """`labels`: this rank's of the step (its cp share); `losses`: the losses it computes."""
        count = torch.stack([(label >= 0).sum() for label in labels]).sum().float()
        return mean_over(self.group, count).clamp(min=1) / losses
