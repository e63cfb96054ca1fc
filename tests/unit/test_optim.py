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


def adamw_settings(implementation: str) -> SimpleNamespace:
    """The optimizer section both AdamW tests build from: lr 1e-2, betas (0.9, 0.95), eps 1e-8, decay 0.1."""
    return SimpleNamespace(
        name="AdamW",
        param_groups=[],
        lr=1e-2,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        implementation=implementation,
    )


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_optimizer_implementations_agree(implementation):
    initial = torch.randn(16, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(initial.clone())
    cfg = adamw_settings(implementation)
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


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_adamw_steps_dtensor_parameters_on_their_local_shards(implementation, monkeypatch):
    """step/local_shards.py: on a one-rank gloo mesh, a sharded, a replicated (its gradient
    arriving as a Partial sum) and a plain parameter train bit for bit as torch's AdamW trains
    them over DTensors; the kernels see plain tensors, and the state stays DTensors laid out
    as the parameters (what checkpoints save and reshard)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    kernels_saw: list[type] = []
    fused = torch._fused_adamw_
    monkeypatch.setattr(
        torch, "_fused_adamw_", lambda params, *a, **k: kernels_saw.append(type(params[0])) or fused(params, *a, **k)
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(0)
        values = [torch.randn(8, 4, generator=g), torch.randn(4, generator=g), torch.randn(3, generator=g)]
        placements = [[Shard(0)], [Replicate()], None]

        def parameters() -> list[torch.nn.Parameter]:
            return [
                torch.nn.Parameter(v.clone() if p is None else distribute_tensor(v.clone(), mesh, p))
                for v, p in zip(values, placements)
            ]

        cfg = adamw_settings(implementation)
        ours, theirs = parameters(), parameters()
        optimizer = build_optimizer([(f"w{i}", p) for i, p in enumerate(ours)], cfg, no_decay=())
        kinds = dict(fused=implementation == "fused", foreach=implementation == "foreach")
        # torch's fused and foreach kernels take no mix of DTensors and plain tensors: two references
        references = [
            torch.optim.AdamW(group, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kinds)
            for group in (theirs[:2], theirs[2:])
        ]
        seen = {}
        for step in range(3):
            for params in (ours, theirs):
                grads = [torch.randn(v.shape, generator=torch.Generator().manual_seed(step)) for v in values]
                params[0].grad = distribute_tensor(grads[0], mesh, [Shard(0)])
                params[1].grad = DTensor.from_local(grads[1], mesh, [Partial()])
                params[2].grad = grads[2]
            for name, stepper in (("ours", optimizer), ("torch's", references[0])):
                kernels_saw.clear()
                stepper.step()
                seen[name] = set(kernels_saw)
            references[1].step()
        for mine, theirs_ in zip(ours, theirs):
            mine, theirs_ = (
                t.full_tensor() if isinstance(t, DTensor) else t for t in (mine.detach(), theirs_.detach())
            )
            torch.testing.assert_close(mine, theirs_, rtol=0, atol=0)
        for param in ours[:2]:
            state = optimizer.state[param]
            assert all(state[key].placements == param.placements for key in ("exp_avg", "exp_avg_sq"))
            assert not isinstance(state["step"], DTensor) and int(state["step"]) == 3
        assert {p for group in optimizer.param_groups for p in group["params"]} == set(ours)
        if implementation == "fused":
            assert seen == {"ours": {torch.Tensor}, "torch's": {DTensor}}
    finally:
        dist.destroy_process_group()
