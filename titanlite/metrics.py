"""Throughput, MFU and memory figures, the per-step log line and TensorBoard scalars."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

import torch

from titanlite.config import Metrics
from titanlite.logging import logger

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
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.nn.functional.linear(a, b)  # warm up the kernel choice
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or spent < budget_s:
        start = time.perf_counter()
        torch.nn.functional.linear(a, b)
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return 2 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype, configured: float) -> PeakFlops:
    """`metrics.peak_flops` when set; else the GPU table; else on CPU a measured matmul.

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
        measured = measure_cpu_matmul_flops(dtype)
        threads = torch.get_num_threads()
        return PeakFlops(measured, f"{str(dtype).removeprefix('torch.')} matmul measured at start-up on {threads} thread(s)")
    return PeakFlops(None, f"no peak known for device type {device.type}; set metrics.peak_flops for MFU")


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocator memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # ru_maxrss is KiB on Linux


def tensorboard_dir(metrics_cfg: Metrics, dump_folder: str, rank: int) -> str | None:
    """`<dump_folder>/<save_tb_folder>/<start time>[-rank<r>]`, or None where this rank
    writes no TensorBoard scalars (disabled, or not rank 0 under rank_0_only)."""
    if not metrics_cfg.enable_tensorboard or (rank != 0 and metrics_cfg.rank_0_only):
        return None
    run_name = time.strftime("%Y%m%d-%H%M%S") + ("" if rank == 0 else f"-rank{rank}")
    return os.path.join(dump_folder, metrics_cfg.save_tb_folder, run_name)


class MetricsLogger:
    """Accumulates tokens between log steps and writes the log line and TensorBoard scalars.

    tps is tokens per second per device: the tokens of this rank's data-parallel group
    divided by the tensor-parallel degree, so MFU = tps * FLOPs/token / peak holds for
    any layout.
    """

    def __init__(self, metrics_cfg: Metrics, dump_folder: str, rank: int, device: torch.device,
                 flops_per_token: float, peak: PeakFlops, tp_degree: int):
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.tp_degree = tp_degree
        self.tokens = 0
        self.window_start = time.perf_counter()
        self.writer = None
        tb_dir = tensorboard_dir(metrics_cfg, dump_folder, rank)
        if tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(tb_dir, exist_ok=True)
            self.writer = SummaryWriter(tb_dir)

    def add_tokens(self, count: int) -> None:
        self.tokens += count

    def log(self, step: int, loss: float, grad_norm: float, lr: float) -> dict[str, float]:
        """Emit one line and the scalars for the window since the last call; returns them."""
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        tps = self.tokens / elapsed / self.tp_degree
        scalars = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "memory_gib": peak_memory_gib(self.device),
        }
        mfu_text = "n/a"
        if self.peak.flops:
            scalars["mfu"] = 100 * tps * self.flops_per_token / self.peak.flops
            mfu_text = f"{scalars['mfu']:.1f}%"
        logger.info(
            f"step {step:>5}  loss {loss:7.4f}  grad_norm {grad_norm:6.3f}  lr {lr:.1e}  "
            f"tps {tps:,.0f}  mfu {mfu_text}  mem {scalars['memory_gib']:.2f} GiB"
        )
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        self.tokens = 0
        self.window_start = time.perf_counter()
        return scalars

    def log_validation(self, step: int, loss: float, perplexity: float) -> dict[str, float]:
        """One validation line and its scalars (validation/loss, validation/perplexity); returns them."""
        scalars = {"validation_loss": loss, "validation_perplexity": perplexity}
        logger.info(f"validation step {step:>5}  loss {loss:7.4f}  perplexity {perplexity:,.2f}")
        if self.writer is not None:
            self.writer.add_scalar("validation/loss", loss, step)
            self.writer.add_scalar("validation/perplexity", perplexity, step)
            self.writer.flush()
        return scalars

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
