"""Throughput, MFU and memory figures, the per-step log line, TensorBoard scalars, the
run folder's metrics.jsonl (see titanlite/observe/run_dir.py) and, with
`metrics.enable_wandb`, the same scalars in Weights & Biases (titanlite/observe/wandb_run.py)."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from titanlite.config import Metrics
from titanlite.logging import logger
from titanlite.observe.peak_flops import PeakFlops
from titanlite.observe.run_dir import METRICS_FILE, MetricsFile
from titanlite.observe.wandb_run import start_wandb_run

# TensorBoard and W&B names of the scalars that metrics.jsonl names otherwise
TAGS = {"validation_loss": "validation/loss", "validation_perplexity": "validation/perplexity"}


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocator memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # ru_maxrss is KiB on Linux


class LineField(NamedTuple):
    """A step participant's part of a logged step: its text on the step line (`quorum 2/2`) and
    its scalars (TensorBoard, W&B, metrics.jsonl and the returned figures)."""

    text: str
    scalars: dict[str, float]


class MetricsLogger:
    """Accumulates tokens between log steps and writes the log line, TensorBoard scalars
    and (rank 0) one metrics.jsonl record per logged step or validation, and the same
    scalars to a W&B run whose config is `run_config` (rank 0, `metrics.enable_wandb`).

    tps is tokens per second per device: the tokens of this rank's data-parallel group
    divided by the devices that share them (`devices_per_replica`: tensor-, context- and
    pipeline-parallel ranks), so MFU = tps * FLOPs/token / peak holds for any layout.
    """

    def __init__(
        self,
        metrics_cfg: Metrics,
        dump_folder: str,
        rank: int,
        device: torch.device,
        flops_per_token: float,
        peak: PeakFlops,
        devices_per_replica: int,
        run_dir: Path,
        run_config: dict[str, Any] | None = None,
    ):
        self.device, self.peak = device, peak
        self.flops_per_token, self.devices_per_replica = flops_per_token, devices_per_replica
        self.tokens = 0
        self.started = self.window_start = time.perf_counter()
        self.file = MetricsFile(run_dir / METRICS_FILE) if rank == 0 else None
        self.writer = None
        # TensorBoard: <dump_folder>/<save_tb_folder>/<run folder's name>[-rank<r>], on rank 0 only under rank_0_only
        if metrics_cfg.enable_tensorboard and (rank == 0 or not metrics_cfg.rank_0_only):
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = os.path.join(
                dump_folder, metrics_cfg.save_tb_folder, run_dir.name + ("" if rank == 0 else f"-rank{rank}")
            )
            os.makedirs(tb_dir, exist_ok=True)
            self.writer = SummaryWriter(tb_dir)
        self.wandb_run = start_wandb_run(run_config or {}, run_dir) if rank == 0 and metrics_cfg.enable_wandb else None

    def add_tokens(self, count: int) -> None:
        self.tokens += count

    def log(
        self, step: int, loss: float, grad_norm: float, lr: float, tokens_seen: int, fields: Sequence[LineField] = ()
    ) -> dict[str, float]:
        """Emit one line and the scalars for the window since the last call; returns them.
        `tokens_seen` counts every rank's tokens since the run's first step (resumes included).
        `fields`: the step participants' own (step/participants.py), after the common ones:
        with MoE layers the expert load, with fault tolerance the quorum."""
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        tps = self.tokens / elapsed / self.devices_per_replica
        memory = peak_memory_gib(self.device)
        scalars = dict(loss=loss, grad_norm=grad_norm, lr=lr, tps=tps, memory_gib=memory, tokens_seen=tokens_seen)
        mfu_text = "n/a"
        if self.peak.flops:
            scalars["mfu"] = 100 * tps * self.flops_per_token / self.peak.flops
            mfu_text = f"{scalars['mfu']:.1f}%"
        for field in fields:
            scalars.update(field.scalars)
        logger.info(
            f"step {step:>5}  loss {loss:7.4f}  grad_norm {grad_norm:6.3f}  lr {lr:.1e}  "
            f"tps {tps:,.0f}  mfu {mfu_text}  mem {scalars['memory_gib']:.2f} GiB"
            + "".join(f"  {field.text}" for field in fields)
        )
        self._record(step, scalars)
        self.tokens = 0
        self.window_start = time.perf_counter()
        return scalars

    def log_validation(self, step: int, loss: float, perplexity: float) -> dict[str, float]:
        """One validation line, TensorBoard scalars (validation/loss, validation/perplexity)
        and its own metrics.jsonl record (the step's training record is already written)."""
        logger.info(f"validation step {step:>5}  loss {loss:7.4f}  perplexity {perplexity:,.2f}")
        scalars = {"validation_loss": loss, "validation_perplexity": perplexity}
        self._record(step, scalars)
        return scalars

    def log_skipped_steps(self, step: int, skipped: int) -> None:
        """The running count of optimizer steps skipped for a non-finite loss or grad norm
        (`training.max_nan_skips`), at the step that was skipped."""
        self._record(step, {"skipped_steps": float(skipped)})

    def _record(self, step: int, scalars: dict[str, float]) -> None:
        """To TensorBoard and W&B (under TAGS[name], else the name) and metrics.jsonl, with the
        wall time (Unix seconds) and the seconds since this logger started (the start of training)."""
        tagged = {TAGS.get(name, name): value for name, value in scalars.items()}
        if self.writer is not None:
            for tag, value in tagged.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(tagged, step=step)
        if self.file is not None:
            elapsed_s = time.perf_counter() - self.started
            self.file.write(
                {"step": step, **scalars, "elapsed_s": round(elapsed_s, 3), "wall_time": round(time.time(), 3)}
            )

    def log_summary(
        self, steps: int, tokens: int, seconds: float, final_loss: float | None, checkpoint: Path | None
    ) -> str:
        """The run's last line (rank 0): what this start trained and where its results are, so a
        user need not scroll back for them. Returns the line: `done: 100 steps, 1,638,400 tokens in
        58.2 s; final loss 5.5412; peak mem 0.75 GiB; checkpoint outputs/checkpoint/step-100;
        metrics outputs/runs/<run>/metrics.jsonl`. tokens are every data-parallel rank's; "none"
        where nothing was saved or written."""
        loss = "n/a" if final_loss is None else f"{final_loss:.4f}"
        line = (
            f"done: {steps:,} steps, {tokens:,} tokens in {seconds:.1f} s; final loss {loss}; peak mem "
            f"{peak_memory_gib(self.device):.2f} GiB; checkpoint {checkpoint or 'none'}; "
            f"metrics {(self.file and self.file.path) or 'none'}"
        )
        logger.info(line)
        return line

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.file is not None:
            self.file.close()
