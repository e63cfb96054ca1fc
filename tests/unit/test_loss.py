"""`titanlite.step.loss.cross_entropy` is F.cross_entropy's mean loss and gradient (issue: throughput).
Vocab-sharded logits (loss parallel) are covered through the trainer by the TP layouts of
tests/runs/test_parallel_equivalence.py and tests/unit/test_gpt2.py (1e-5 against one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanlite.step.loss import cross_entropy


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
