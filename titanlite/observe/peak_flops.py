"""The peak FLOP/s that MFU divides by: a table of known GPUs, or on CPU a matmul measured on
one process's threads, once per host: its local rank 0 measures while the host's other ranks
wait, and they all divide by that figure. Measured by every process at once, each figure
depended on what the others were doing at that moment (MFU 13% on one rank, 94% on another
of the same run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Dense bf16 tensor-core peaks (FLOP/s) by device-name substring, most specific first.
GPU_BF16_PEAK_FLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H20", 148e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
]


@dataclass(frozen=True)
class PeakFlops:
    """Peak FLOP/s of one device and where the number came from (printed at start-up)."""

    flops: float | None
    source: str


def measure_cpu_matmul_flops(dtype: torch.dtype, size: int = 1024, budget_s: float = 0.5) -> float:
    """Best rate of `F.linear` (the op nn.Linear runs) on this process's threads: the CPU's
    practical peak. Repeats until `budget_s` is spent (at least twice), so a CPU without
    fast bf16 (where one product takes a quarter second) does not stall start-up."""
    a, b = (torch.randn(size, size, dtype=dtype) for _ in range(2))
    torch.nn.functional.linear(a, b)  # warm up the kernel choice
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or spent < budget_s:
        start = time.perf_counter()
        torch.nn.functional.linear(a, b)
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return 2 * size**3 / best


def host_cpu_matmul_flops(dtype: torch.dtype, local_rank: int) -> float:
    """`measure_cpu_matmul_flops` on this host's local rank 0, the figure every rank of the
    host uses: the others wait in a barrier while it measures (collectives over every rank;
    torchrun numbers a host's ranks on from its local rank 0)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return measure_cpu_matmul_flops(dtype)
    dist.barrier()
    figures = [None] * dist.get_world_size()
    dist.all_gather_object(figures, measure_cpu_matmul_flops(dtype) if local_rank == 0 else None)
    return figures[dist.get_rank() - local_rank]


def peak_flops(device: torch.device, dtype: torch.dtype, configured: float, local_rank: int = 0) -> PeakFlops:
    """`metrics.peak_flops` when set; else the GPU table; else on CPU a matmul measured once
    per host (`host_cpu_matmul_flops`).

    An unknown GPU gives no MFU (and says so) rather than borrowing another chip's peak.
    """
    if configured > 0:
        return PeakFlops(configured, "metrics.peak_flops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, bf16_peak in GPU_BF16_PEAK_FLOPS:
            if key in name:
                if dtype == torch.float32:
                    return PeakFlops(bf16_peak / 2, f"{name}, TF32 peak (half the bf16 table entry)")
                return PeakFlops(bf16_peak, f"{name}, dense bf16 peak from the table")
        return PeakFlops(None, f"{name} is not in the peak table; set metrics.peak_flops for MFU")
    if device.type == "cpu":
        source = f"{dtype} matmul on {torch.get_num_threads()} thread(s), measured at start-up by local rank 0"
        return PeakFlops(host_cpu_matmul_flops(dtype, local_rank), source)
    return PeakFlops(None, f"no peak known for device type {device.type}; set metrics.peak_flops for MFU")
