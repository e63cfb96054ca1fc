"""The compute dtype of a run: `training.mixed_precision_param`, with "auto" decided per host.

Mixed precision here always keeps float32 master weights, optimizer state and gradient
reductions; only forward/backward compute runs in the chosen dtype (FSDP's parameter dtype,
or autocast without FSDP). "auto" picks bfloat16 where the hardware has bf16 units and
float32 where it does not, from what the hardware reports, never from a timing: a timing
taken on a busy host once picked float32 and minutes later bfloat16 for the same run, with
different losses. The same host and config give the same dtype every time.

- CUDA: bfloat16 on compute capability >= 8.0 (Ampere on), whose tensor cores run bf16;
  older GPUs only emulate it (`torch.cuda.is_bf16_supported()` says True there too).
- CPU: bfloat16 when oneDNN reports native bf16 matmuls (AVX512-BF16 or AMX), about 4x
  float32's rate on such a host; without them bf16 is emulated, 2-3x slower than float32
  (seen on an AVX2 host).

Every rank must compute in the same dtype, so rank 0's decision is broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.config.dtypes import DTYPES
from titanlite.parallel.collectives import on_rank0

MIN_BF16_CAPABILITY = (8, 0)
"""The CUDA compute capability from which GPUs run bf16 natively (Ampere)."""


@dataclass(frozen=True)
class ComputeDtype:
    """The resolved `mixed_precision_param` ("float32" or "bfloat16") and why, for the log."""

    name: str
    reason: str


def cpu_has_native_bf16() -> bool:
    """oneDNN's own test for bf16 matmul instructions (AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def decide_compute_dtype(setting: str, device: torch.device) -> ComputeDtype:
    """This process's choice for `setting` ("auto" or an explicit dtype name) on `device`."""
    if setting != "auto":
        return ComputeDtype(setting, "set by training.mixed_precision_param")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return ComputeDtype(
            "bfloat16" if (major, minor) >= MIN_BF16_CAPABILITY else "float32",
            f"auto: this GPU is SM {major}.{minor} (native bf16 from SM {'.'.join(map(str, MIN_BF16_CAPABILITY))})",
        )
    if device.type != "cpu":
        return ComputeDtype("float32", f"auto: no bf16 rule for device type {device.type}")
    if cpu_has_native_bf16():
        return ComputeDtype("bfloat16", "auto: this CPU has native bf16 matmuls (oneDNN: AVX512-BF16 or AMX)")
    return ComputeDtype("float32", "auto: this CPU has no native bf16 matmuls (oneDNN: no AVX512-BF16 or AMX)")


def resolve_compute_dtype(setting: str, device: torch.device) -> ComputeDtype:
    """The one compute dtype every rank uses: rank 0's decision, broadcast when "auto"."""
    spread = setting == "auto" and dist.is_initialized() and dist.get_world_size() > 1
    return on_rank0(dist.group.WORLD if spread else None, lambda: decide_compute_dtype(setting, device))


def autocast_dtype(setting: str, fsdp: bool) -> torch.dtype | None:
    """The dtype a forward autocasts to for a concrete `setting` (after `resolve_compute_dtype`):
    none under FSDP, whose mixed-precision policy casts the parameters itself, nor in float32."""
    dtype = DTYPES[setting]
    return dtype if not fsdp and dtype != torch.float32 else None
