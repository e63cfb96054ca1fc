"""The warmup-stable-decay schedule and the optimizer choices."""

from types import SimpleNamespace

import pytest
import torch

from titanlite.config import load_config
from titanlite.errors import TitanliteError
from titanlite.step.optim import build_lr_scheduler, build_optimizer, lr_factor


def test_linear_warmup_then_linear_decay_to_lr_min():
    values = [lr_factor(s, 10, 2, None, "linear", 0.1) for s in range(1, 11)]
    assert values[:2] == [0.5, 1.0]
    assert values[-1] == pytest.approx(0.1)
    assert values[2] == pytest.approx(0.1 + 0.9 * (1 - 1 / 8))
    assert all(a >= b for a, b in zip(values[1:], values[2:]))


def test_cosine_decay_and_stable_phase():
    # 2 warmup, 8 post-warmup, decay over the last half of those: steps 3..6 stable.
    values = [lr_factor(s, 10, 2, 0.5, "cosine", 0.0) for s in range(1, 11)]
    assert values[2:6] == [1.0] * 4
    assert values[7] == pytest.approx(0.5)  # halfway through the 4 decay steps
    assert values[-1] == pytest.approx(0.0)


def test_scheduler_sets_the_lr_each_step():
    param = torch.nn.Parameter(torch.zeros(2))
    cfg = SimpleNamespace(
        name="AdamW",
        param_groups=[],
        lr=1e-3,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        implementation="for-loop",
    )
    optimizer = build_optimizer([("w", param)], cfg, no_decay=())
    schedule = build_lr_scheduler(
        optimizer, SimpleNamespace(warmup_steps=4, decay_ratio=None, decay_type="linear", lr_min=0.0), 8
    )
    seen = []
    for _ in range(8):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert seen[-1] == pytest.approx(0.0)


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_optimizer_implementations_agree(implementation):
    initial = torch.randn(16, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(initial.clone())
    cfg = SimpleNamespace(
        name="AdamW",
        param_groups=[],
        lr=1e-2,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        implementation=implementation,
    )
    optimizer = build_optimizer([("w", param)], cfg, no_decay=())
    param.grad = torch.ones(16)
    optimizer.step()
    # First AdamW step: decoupled decay, then lr * m_hat / (sqrt(v_hat) + eps) = lr * g / (|g| + eps).
    expected = initial * (1 - 1e-2 * 0.1) - 1e-2 * torch.ones(16) / (1 + 1e-8)
    assert torch.allclose(param.detach(), expected, atol=1e-6)


def test_torchtitans_early_step_in_backward_is_a_note_when_off_and_refused_when_on():
    notices: list[str] = []
    load_config(["--config", "debug_model", "--optimizer.early_step_in_backward", "false"], notices)
    assert notices == [
        "optimizer.early_step_in_backward = false on the command line: torchtitan's option, off; titanlite steps "
        "the optimizer once after backward, never per parameter inside it"
    ]
    with pytest.raises(TitanliteError, match="^optimizer.early_step_in_backward: not supported"):
        load_config(["--optimizer.early_step_in_backward", "true"])
