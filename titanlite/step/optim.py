"""AdamW over the (possibly sharded DTensor) parameters and the warmup-stable-decay schedule."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(params: list[torch.nn.Parameter], optimizer_cfg) -> torch.optim.AdamW:
    """AdamW with torchtitan's knobs; `implementation` picks fused, foreach or for-loop kernels."""
    impl = optimizer_cfg.implementation
    return torch.optim.AdamW(
        params,
        lr=optimizer_cfg.lr,
        betas=(optimizer_cfg.beta1, optimizer_cfg.beta2),
        eps=optimizer_cfg.eps,
        weight_decay=optimizer_cfg.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def lr_factor(
    step: int, total_steps: int, warmup_steps: int, decay_ratio: float | None, decay_type: str, lr_min: float
) -> float:
    """Multiplier of the peak lr at training step `step` (1-based).

    Linear warmup to 1 over `warmup_steps`, then stable, then decay to `lr_min` over the
    last `decay_ratio` of the post-warmup steps (all of them when decay_ratio is None),
    reaching exactly lr_min at the final step.
    """
    if step <= warmup_steps:
        return step / warmup_steps
    post_warmup = total_steps - warmup_steps
    decay_steps = post_warmup if decay_ratio is None else round(post_warmup * decay_ratio)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    remaining = 1.0 - progress if decay_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr_min + (1.0 - lr_min) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, lr_cfg, total_steps: int) -> LambdaLR:
    """LambdaLR whose counter is the number of steps taken; step n trains with lr_factor(n)."""

    def factor(steps_taken: int) -> float:
        return lr_factor(
            steps_taken + 1, total_steps, lr_cfg.warmup_steps, lr_cfg.decay_ratio, lr_cfg.decay_type, lr_cfg.lr_min
        )

    return LambdaLR(optimizer, factor)
