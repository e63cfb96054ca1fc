"""The optimizer over the (possibly sharded DTensor) parameters, in parameter groups, and the
warmup-stable-decay schedule.

Groups come from `optimizer.param_groups` (`config/param_groups.py`): each parameter, by its
name as the model names it, takes the first matching entry's lr scale and weight decay; an
entry's `@no_decay` is the model's own no-decay patterns (`ModelSpec.no_decay`). Every
torch param group carries `group` (GROUP_KEY), the rule it came from with its effective settings, so a
checkpoint records which rule each parameter trained under (`parallel/optim_state.py` refuses
a resume under other rules).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from titanlite.config.param_groups import GroupSpec, group_of, parse_groups
from titanlite.parallel.optim_state import GROUP_KEY, clean_name
from titanlite.step.local_shards import AdamW
from titanlite.step.muon import Muon, takes_muon

NamedParams = list[tuple[str, torch.nn.Parameter]]


def trained_parameters(model: torch.nn.Module) -> NamedParams:
    """(name, parameter) for every parameter that trains, named as the model names it: without
    the prefixes activation checkpointing, torch.compile and FSDP1 wrappers add."""
    return [(clean_name(name), param) for name, param in model.named_parameters() if param.requires_grad]


def build_optimizer(named_params: NamedParams, optimizer_cfg, *, no_decay: tuple[str, ...]) -> torch.optim.Optimizer:
    """AdamW with torchtitan's knobs (`implementation` picks fused, foreach or for-loop kernels;
    stepped on DTensors' local shards: step/local_shards.py),
    or Muon (`step/muon.py`) for the hidden matrices with AdamW for the rest. `named_params`:
    (name as the model names it, parameter) for every trained parameter; `no_decay`: the model's
    no-decay patterns (`ModelSpec.no_decay`), which a `@no_decay` in the groups stands for."""
    groups = param_groups(named_params, optimizer_cfg, no_decay)
    betas = (optimizer_cfg.beta1, optimizer_cfg.beta2)
    common = dict(lr=optimizer_cfg.lr, betas=betas, eps=optimizer_cfg.eps, weight_decay=optimizer_cfg.weight_decay)
    if optimizer_cfg.name == "Muon":
        return Muon(
            groups,
            **common,
            momentum=optimizer_cfg.muon_momentum,
            nesterov=optimizer_cfg.muon_nesterov,
            ns_steps=optimizer_cfg.muon_newton_schulz_steps,
            adjust_lr_fn=optimizer_cfg.muon_adjust_lr,
            names={id(param): name for name, param in named_params},
        )
    impl = optimizer_cfg.implementation
    return AdamW(groups, **common, fused=impl == "fused", foreach=impl == "foreach")


def param_groups(named_params: NamedParams, optimizer_cfg, no_decay: tuple[str, ...]) -> list[dict]:
    """torch param groups, one per (rule, update) pair that has parameters, in the order of
    the rules (the unmatched parameters last), each rule's `@no_decay` the model's patterns.
    Under Muon each rule splits into the matrices Muon updates and the rest, which AdamW updates."""
    specs = parse_groups(optimizer_cfg.param_groups, no_decay)
    muon = optimizer_cfg.name == "Muon"
    buckets: dict[tuple[int, bool], tuple[GroupSpec | None, list[torch.nn.Parameter]]] = {}
    for name, param in named_params:
        spec = group_of(name, specs)
        index = len(specs) if spec is None else specs.index(spec)
        buckets.setdefault((index, muon and takes_muon(name, param)), (spec, []))[1].append(param)
    return [
        _group(params, spec, optimizer_cfg, on_muon, muon) for (_, on_muon), (spec, params) in sorted(buckets.items())
    ]


def _group(params: list, spec: GroupSpec | None, cfg, on_muon: bool, muon: bool) -> dict:
    lr_scale = 1.0 if spec is None or spec.lr_scale is None else spec.lr_scale
    weight_decay = cfg.weight_decay if spec is None or spec.weight_decay is None else spec.weight_decay
    base_lr = (cfg.muon_lr or cfg.lr) if on_muon else cfg.lr
    rule = "others" if spec is None else " ".join(spec.patterns)
    name = f"{rule}: lr_scale={lr_scale:g} weight_decay={weight_decay:g}"
    group = {"params": params, "lr": base_lr * lr_scale, "weight_decay": weight_decay, GROUP_KEY: name}
    if muon:
        group["algorithm"] = "muon" if on_muon else "adamw"
        group[GROUP_KEY] = f"{name} ({group['algorithm']})"
    return group


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
    """LambdaLR whose counter is the number of steps taken; step n trains with lr_factor(n),
    every group's lr times the same factor."""

    def factor(steps_taken: int) -> float:
        return lr_factor(
            steps_taken + 1, total_steps, lr_cfg.warmup_steps, lr_cfg.decay_ratio, lr_cfg.decay_type, lr_cfg.lr_min
        )

    return LambdaLR(optimizer, factor)


def current_factor(lr_scheduler: LambdaLR) -> float:
    """The schedule's factor for the step about to be taken (optimizer.lr times it is the lr logged)."""
    return lr_scheduler.lr_lambdas[0](lr_scheduler.last_epoch)
