"""The `optimizer` section: AdamW or Muon, their hyperparameters and the parameter groups
(`param_groups.py` parses the entries); `sections.JobConfig` holds it. Its own module so the
sections file stays within the size limit (docs/recipes.md says what each key does)."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.engine import option as _opt
from titanlite.config.param_groups import DEFAULT_GROUPS


@dataclass
class Optimizer:
    """AdamW, or Muon for the hidden matrices with AdamW for the rest, in parameter groups."""

    name: str = _opt(
        "AdamW",
        "optimizer: AdamW for every parameter, or Muon for the hidden matrices (attention, MLP, each routed "
        "expert) with AdamW for embeddings, output head, norms and biases",
        choices=("AdamW", "Muon"),
    )
    lr: float = _opt(8e-4, "peak learning rate (reached at the end of warmup); AdamW's under Muon", gt=0)
    beta1: float = _opt(0.9, "AdamW first-moment decay", ge=0, lt=1)
    beta2: float = _opt(0.95, "AdamW second-moment decay", ge=0, lt=1)
    eps: float = _opt(1e-8, "AdamW denominator epsilon", gt=0)
    weight_decay: float = _opt(0.1, "decoupled weight decay of the parameters no param_groups entry matches", ge=0)
    implementation: str = _opt(
        "fused",
        "AdamW kernels: one fused kernel (CPU and GPU), multi-tensor foreach, or a per-parameter loop",
        choices=("fused", "foreach", "for-loop"),
    )
    param_groups: list[str] = _opt(
        list(DEFAULT_GROUPS),
        "parameter groups, first match wins: 'PATTERN [PATTERN ...]: lr_scale=X weight_decay=Y' with shell-style "
        "patterns on the parameter names (layers.0.attention.wq.weight), @no_decay standing for the model's own "
        "no-decay patterns (its embeddings, norms and biases); unmatched parameters train with lr and weight_decay; "
        "the default exempts the model's embeddings, norms and biases from weight decay",
    )
    muon_lr: float | None = _opt(
        None, "Muon's peak learning rate for the hidden matrices; none = optimizer.lr", gt=0, special=None
    )
    muon_momentum: float = _opt(0.95, "Muon's momentum", ge=0, lt=1)
    muon_nesterov: bool = _opt(True, "Muon: Nesterov momentum")
    muon_newton_schulz_steps: int = _opt(5, "Muon: Newton-Schulz iterations per step", ge=1, lt=100)
    muon_adjust_lr: str = _opt(
        "original",
        "Muon's per-matrix lr scale: original (sqrt(max(1, rows/cols)), Keller Jordan) or match_rms_adamw "
        "(0.2 * sqrt(max(rows, cols)), Moonlight: the update's RMS matches AdamW's, so AdamW's lr carries over)",
        choices=("original", "match_rms_adamw"),
    )
