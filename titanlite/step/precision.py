"""The compute dtype of a run: `training.mixed_precision_param`, with "auto" decided per host.

Mixed precision here always keeps float32 master weights, optimizer state and gradient
reductions; only forward/backward compute runs in the chosen dtype (FSDP's parameter dtype,
or autocast without FSDP). "auto" picks bfloat16 where it is fast and float32 where it is not:

- CUDA: bfloat16 when the GPU supports it;
- CPU: bfloat16 only when oneDNN reports native bf16 matmuls (AVX512-BF16 / AMX) *and* a
  bf16 matmul measured on this process's threads is at least `MIN_BF16_SPEEDUP` times the
  float32 one. A CPU without them emulates bf16 at 5-10x the cost of float32 (seen on an
  AVX2 host), and a flag alone does not say whether the units are fast.

Every rank must compute in the same dtype, so rank 0's decision is broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.config.dtypes import DTYPES
from titanlite.observe.peak_flops import measure_cpu_matmul_flops
from titanlite.parallel.collectives import on_rank0

MIN_BF16_SPEEDUP = 1.3
"""bf16 must beat float32 matmuls by this much to be worth its rounding."""


@dataclass(frozen=True)
class ComputeDtype:
    """The resolved `mixed_precision_param` ("float32" or "bfloat16") and why, for the log."""

    name: str
    reason: str


def cpu_has_native_bf16() -> bool:
    """oneDNN's own test for bf16 matmul instructions (AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_matmul_speedup(budget_s: float = 0.2) -> float:
    """bf16 over float32 `F.linear` rate on this process's threads (1024^3 products)."""
    bf16 = measure_cpu_matmul_flops(torch.bfloat16, budget_s=budget_s)
    fp32 = measure_cpu_matmul_flops(torch.float32, budget_s=budget_s)
    return bf16 / fp32


def decide_compute_dtype(setting: str, device: torch.device) -> ComputeDtype:
    """This process's choice for `setting` ("auto" or an explicit dtype name) on `device`."""
    if setting != "auto":
        return ComputeDtype(setting, "set by training.mixed_precision_param")
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
        return ComputeDtype(
            "bfloat16" if supported else "float32", f"auto: this GPU {'has' if supported else 'lacks'} bf16"
        )
    if device.type != "cpu":
        return ComputeDtype("float32", f"auto: no bf16 rule for device type {device.type}")
    if not cpu_has_native_bf16():
        return ComputeDtype("float32", "auto: this CPU has no native bf16 matmul (oneDNN)")
    speedup = bf16_matmul_speedup()
    name = "bfloat16" if speedup >= MIN_BF16_SPEEDUP else "float32"
    return ComputeDtype(name, f"auto: bf16 matmuls measured {speedup:.2f}x float32 (bf16 needs {MIN_BF16_SPEEDUP}x)")


def resolve_compute_dtype(setting: str, device: torch.device) -> ComputeDtype:
    """The one compute dtype every rank uses: rank 0's decision, broadcast when "auto"."""
    spread = setting == "auto" and dist.is_initialized() and dist.get_world_size() > 1
    return on_rank0(dist.group.WORLD if spread else None, lambda: decide_compute_dtype(setting, device))


def autocast_dtype(setting: str, fsdp: bool) -> torch.dtype | None:
    """The dtype a forward autocasts to for a concrete `setting` (after `resolve_compute_dtype`):
    none under FSDP, whose mixed-precision policy casts the parameters itself, nor in float32."""
    dtype = DTYPES[setting]
    return dtype if not fsdp and dtype != torch.float32 else None
