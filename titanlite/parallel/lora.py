"""LoRA: low-rank adapters on a frozen model (`model.converters = ["lora"]`, the `[lora]` section), as
Hugging Face's PEFT trains them, so that its adapter folders and ours are one format.

Each target linear becomes a `LoRALinear`: the same module (its weight and bias keep their names,
so checkpoints and HF names of the base do not change) with two more parameters, `lora_a`
[rank, in] and `lora_b` [out, rank], and `y = W x + b + (alpha / rank) B A dropout(x)`. Every
other parameter is frozen: the optimizer, gradient clipping and FSDP's reduce-scatters see the
adapters only.

The conversion runs after tensor parallelism (`parallel/parallelize.py`), so the adapters are
laid out like their base weight, whatever style the plan gave it: under a colwise weight
(Shard(0): output rows) B is sharded by rows and A replicated; under a rowwise one (Shard(1):
input columns) A is sharded by columns and B replicated (its partial products are summed with
the base's, in the same all-reduce); a replicated weight gets replicated adapters. FSDP then
shards them over the data-parallel ranks like any parameter.

A starts as PEFT's default (kaiming-uniform with a = sqrt(5): uniform within 1 / sqrt(in)) and
B at zero, so the converted model starts as the base (`models/init.init_adapters`: the values are
a function of the seed and the parameter's name, the same at every layout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from titanlite.errors import TitanliteError

ADAPTERS = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """A linear with adapters (`convert`); its `weight` and `bias` are the base's, frozen."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapted = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + adapted * self.scale


def matches(name: str, targets: list[str]) -> bool:
    """Whether module `name` is one of `targets`: its last name, or a dotted end of its name."""
    return any(name == target or name.endswith("." + target) for target in targets)


def convert(model: nn.Module, settings: Any) -> list[str]:
    """Give `model`'s target linears adapters in place (`settings`: the `[lora]` section: rank,
    alpha, dropout, target_modules) and freeze every other parameter; returns their names."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    chosen = [(name, m) for name, m in linears if matches(name, settings.target_modules)]
    if not chosen:
        last = sorted({name.rsplit(".", 1)[-1] for name, _ in linears})
        raise TitanliteError(
            f"lora.target_modules: {settings.target_modules} match no linear layer of the model (its linears: "
            f"{', '.join(last)})"
        )
    for param in model.parameters():
        param.requires_grad_(False)
    for _, linear in chosen:
        _add_adapters(linear, settings)
    return [name for name, _ in chosen]


def _add_adapters(linear: nn.Linear, settings: Any) -> None:
    weight = linear.weight
    shapes = {"lora_a": (settings.rank, linear.in_features), "lora_b": (linear.out_features, settings.rank)}
    for key, shape in shapes.items():
        value = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        if isinstance(weight, DTensor):  # on meta (the trainer's build) this only records the layout
            value = distribute_tensor(value, weight.device_mesh, _placements(key, weight))
        linear.register_parameter(key, nn.Parameter(value))
    linear.__class__ = LoRALinear
    linear.scale = settings.alpha / settings.rank
    linear.lora_dropout = nn.Dropout(settings.dropout) if settings.dropout else nn.Identity()


def _placements(key: str, weight: DTensor) -> list[Any]:
    """An adapter's layout from its base weight's: B [out, rank] shares the weight's rows (dim 0),
    A [rank, in] its columns (dim 1); each is sharded where the weight is along the dim they share."""
    shared = 0 if key == "lora_b" else 1
    return [Shard(shared) if p == Shard(shared) else Replicate() for p in weight.placements]


def is_adapter(key: str) -> bool:
    """Whether a state-dict key is an adapter's."""
    return key.rsplit(".", 1)[-1] in ADAPTERS
