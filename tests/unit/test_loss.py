"""`titanlite.step.loss.cross_entropy` is F.cross_entropy's mean loss and gradient (issue: throughput).
Vocab-sharded logits (loss parallel) are covered through the trainer by the TP layouts of
tests/runs/test_parallel_equivalence.py and tests/unit/test_gpt2.py (1e-5 against one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanlite.step.loss import LabelCount, cross_entropy


def loss_and_grad(fn, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.detach().requires_grad_()
    loss = fn(logits, labels)
    loss.backward()
    return loss.detach(), logits.grad


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: large logits, where a naive exp overflows
def test_matches_torch_in_float32(scale):
    generator = torch.Generator().manual_seed(0)
    logits = scale * torch.randn(3, 16, 97, generator=generator)
    labels = torch.randint(0, 97, (3, 16), generator=generator)
    ours, ours_grad = loss_and_grad(cross_entropy, logits, labels)
    theirs, their_grad = loss_and_grad(reference, logits, labels)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_grad, their_grad, rtol=1e-5, atol=1e-8)


def test_bfloat16_logits_reduce_in_float32():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 8, 64, generator=generator).bfloat16()
    labels = torch.randint(0, 64, (2, 8), generator=generator)
    ours, ours_grad = loss_and_grad(cross_entropy, logits, labels)
    theirs, their_grad = loss_and_grad(reference, logits, labels)
    assert ours.dtype == torch.float32 and ours_grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_grad, their_grad, rtol=1e-2, atol=1e-4)  # bf16 rounding of the gradient


def test_masked_labels_take_no_loss_and_the_sum_is_divided_by_the_tokens_given():
    """Chat data: labels < 0 (the loader's IGNORE, -100) take no loss and no gradient; the rest
    sum, divided by `tokens` (the step's count, step/loss.LabelCount), as F.cross_entropy's
    ignore_index sum is."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 12, 50, generator=generator)
    labels = torch.randint(0, 50, (2, 12), generator=generator)
    labels[torch.rand(2, 12, generator=generator) < 0.5] = -100
    tokens = torch.tensor(7.0)  # another count than this batch's: a share of a larger step

    def theirs(x, y):
        return F.cross_entropy(x.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum") / tokens

    ours, ours_grad = loss_and_grad(lambda x, y: cross_entropy(x, y, tokens), logits, labels)
    expected, expected_grad = loss_and_grad(theirs, logits, labels)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_grad, expected_grad, rtol=1e-5, atol=1e-8)
    assert not ours_grad[labels == -100].any()


def test_one_rank_counts_the_trained_labels_of_its_step_per_loss():
    labels = [torch.tensor([[1, -100, 3], [-100, -100, 4]]), torch.tensor([[5, 6, -100]])]
    assert LabelCount(None)(labels, 2).item() == 5 / 2
    assert LabelCount(None)([torch.full((2, 3), -100)], 1).item() == 1  # nothing trained: the sum is 0 anyway
