"""Layout-independent weight initialization that costs each rank only its own shard.

Every element's value is a pure function of (training.seed, the parameter's name, the
element's global index): a counter-based generator. A rank asks DTensor which global rows
and columns its local shard holds and computes just those values, so

- a model initialized on 1 process, on FSDP, TP, HSDP or any mix holds exactly the same
  weights (which lets every parallel layout be tested against one process), and
- time and memory follow the shard, not the model: values are made in chunks of at most
  `CHUNK_ELEMENTS` (or one row, if longer), so the scratch is bounded whatever the
  parameter's size. Rank 0 of Llama 3.1 70B on 512 ranks fills its 1/512 in seconds;
  drawing each full tensor and slicing it took longer than 10 minutes there.

The generator: the global flat index, split into two 32-bit halves, is mixed with two
32-bit keys derived from (seed, name) by two rounds of a 32-bit integer hash (Wellons'
"lowbias32"), all in int64 arithmetic that never overflows. The top 24 bits make a
uniform number strictly inside (-1, 1), which the inverse normal CDF (erfinv) turns into
a normal or truncated-normal value, the way `torch.nn.init.trunc_normal_` samples.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.parallel.lora import LoRALinear
from titanlite.parallel.placement import local_tensor, shard_indices

CHUNK_ELEMENTS = 1 << 16
"""Values generated at once: the scratch is a few int64 tensors of this size, small enough
to stay in cache (larger chunks ran slower on CPU)."""

# Module attributes that wrappers insert between a model's own names (activation
# checkpointing, torch.compile); a parameter's key is its name without them.
WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})

_MASK32 = 0xFFFFFFFF


def unwrapped_name(name: str) -> str:
    """`layers.0._checkpoint_wrapped_module.attention.wq.weight` -> `layers.0.attention.wq.weight`."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


class ShardInit:
    """Initializers that fill this rank's shard of a plain or DTensor parameter of `model`.

    A parameter is keyed by its name in `model` (wrappers stripped), so its values do not
    depend on the order in which parameters are initialized either.
    """

    def __init__(self, model: nn.Module, seed: int):
        self.seed = seed
        self.names = {id(param): unwrapped_name(name) for name, param in model.named_parameters()}
        self._indices: dict[tuple, list[torch.Tensor]] = {}

    def normal(self, param: torch.Tensor, std: float) -> None:
        self._fill(param, lambda s: normal_from_uniform(s, std, -1.0, 1.0))

    def trunc_normal(self, param: torch.Tensor, std: float, a: float = -2.0, b: float = 2.0) -> None:
        """Normal(0, std) truncated to [a, b] (absolute bounds, as `torch.nn.init.trunc_normal_`)."""
        low, high = (math.erf(bound / (std * math.sqrt(2.0))) for bound in (a, b))
        self._fill(param, lambda s: normal_from_uniform(s, std, low, high).clamp_(a, b))

    def uniform(self, param: torch.Tensor, bound: float) -> None:
        """Uniform in (-bound, bound)."""
        self._fill(param, lambda s: s.mul_(bound))

    @torch.no_grad()
    def ones(self, param: torch.Tensor) -> None:
        local_tensor(param).fill_(1.0)

    @torch.no_grad()
    def zeros(self, param: torch.Tensor) -> None:
        local_tensor(param).zero_()

    @torch.no_grad()
    def _fill(self, param: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        local = local_tensor(param)
        if local.numel() == 0:
            return
        keys = parameter_keys(self.seed, self.names[id(param)])
        indices = self._shard_indices(param)
        strides = torch.empty(param.shape, device="meta").stride()
        offsets = [index.to(local.device) * stride for index, stride in zip(indices, strides)]
        wide = param.numel() >= 1 << 32
        for start, stop in row_chunks(local.shape):
            flat = _outer_sum([offsets[0][start:stop], *offsets[1:]])
            local[start:stop].copy_(transform(signed_uniform(flat, keys, wide)))

    def _shard_indices(self, param: torch.Tensor) -> list[torch.Tensor]:
        if not isinstance(param, DTensor):
            return [torch.arange(size) for size in param.shape]
        key = (tuple(param.shape), tuple(param.placements), param.device_mesh)
        if key not in self._indices:
            self._indices[key] = shard_indices(param.shape, param.device_mesh, param.placements)
        return self._indices[key]


def parameter_keys(seed: int, name: str) -> tuple[int, int]:
    """Two 32-bit keys for (seed, name), the same in every process (unlike `hash`)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def row_chunks(shape: torch.Size) -> list[tuple[int, int]]:
    """[start, stop) ranges of the leading dim, each at most CHUNK_ELEMENTS (or one row)."""
    per_row = math.prod(shape[1:])
    rows = max(1, CHUNK_ELEMENTS // max(per_row, 1))
    return [(start, min(start + rows, shape[0])) for start in range(0, shape[0], rows)]


def signed_uniform(flat: torch.Tensor, keys: tuple[int, int], wide: bool) -> torch.Tensor:
    """float32 values uniform in (-1, 1), one per int64 global index in `flat` (consumed).

    `wide`: the parameter has 2^32 elements or more, so the index's high half is mixed in
    too (it is 0, and skipped, otherwise). The 24 kept bits k give (2k + 1 - 2^24) / 2^24:
    exact in float32, symmetric, and never +-1.
    """
    high = ((flat >> 32) + keys[1]) & _MASK32 if wide else keys[1]
    bits = _mix32_(flat.bitwise_and_(_MASK32).bitwise_xor_(keys[0]))
    bits = _mix32_(bits.bitwise_xor_(high))
    return bits.bitwise_right_shift_(8).mul_(2).sub_((1 << 24) - 1).float().mul_(2.0**-24)


def normal_from_uniform(s: torch.Tensor, std: float, low: float, high: float) -> torch.Tensor:
    """Inverse-CDF sampling: s uniform in (-1, 1) -> std * sqrt(2) * erfinv(v), v uniform in
    (low, high). (-1, 1) is a plain normal; erf(a / (std sqrt 2)), erf(b / (std sqrt 2))
    truncate it to [a, b], as `torch.nn.init.trunc_normal_` does."""
    v = s.mul_((high - low) / 2).add_((high + low) / 2)
    return v.erfinv_().mul_(std * math.sqrt(2.0))


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32, in place, on uint32 values held in int64. The second multiplier
    (>= 2^31) is applied as its negative twin modulo 2^32, so no product leaves int64."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(0x846CA68B - (1 << 32)).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def _outer_sum(offsets: list[torch.Tensor]) -> torch.Tensor:
    """Every combination of per-dim offsets summed: the flat global index of each local
    element, in a new tensor (the caller consumes it in place)."""
    flat = offsets[0].clone()
    for offset in offsets[1:]:
        flat = flat.unsqueeze(-1) + offset
    return flat


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's start for every adapter of `model`, this rank's shard only: A uniform within
    1 / sqrt(in) (kaiming-uniform with a = sqrt(5)), B zero. Nothing without adapters."""
    adapted = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if not adapted:
        return
    init = ShardInit(model, seed)
    for module in adapted:
        init.uniform(module.lora_a, 1 / math.sqrt(module.in_features))
        init.zeros(module.lora_b)
