"""The run folder: what one start of the trainer leaves behind for a user to read.

`<job.dump_folder>/<metrics.save_runs_folder>/<start time>` (e.g. `outputs/runs/20261123-101500`)
holds

- `config.toml`: the config this run used, after overrides, written before the model is
  built; `--config outputs/runs/<name>/config.toml` runs it again;
- `metrics.jsonl`: one JSON object per line, each flushed as it is logged (`MetricsFile`), so
  a crash loses nothing already logged and a user can plot without TensorBoard
  (`scripts/plot_run.py`);
- `wandb/`: with `metrics.enable_wandb`, W&B's local files, unless WANDB_DIR names another
  place (`wandb_run.py`).

Rank 0 creates the folder and is the only rank that writes there; every rank learns its
name, which TensorBoard's folder (`<dump_folder>/<save_tb_folder>/<same name>`) shares. A
resumed run is a new start, so it gets a new run folder; its step numbers continue from
the checkpoint's.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titanlite.config import JobConfig, to_toml
from titanlite.errors import TitanliteError
from titanlite.parallel.collectives import on_rank0

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"


def create_run_dir(cfg: JobConfig) -> Path:
    """A fresh folder named after the start time (`-2`, `-3`, ... when a run started in the
    same second has that name), holding the run's config.toml."""
    parent = Path(cfg.job.dump_folder) / cfg.metrics.save_runs_folder
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for attempt in itertools.count(1):
            path = parent / (stamp if attempt == 1 else f"{stamp}-{attempt}")
            with contextlib.suppress(FileExistsError):
                path.mkdir()
                break
        temporary = path / f".{CONFIG_FILE}.tmp"
        temporary.write_text(to_toml(cfg))
        os.replace(temporary, path / CONFIG_FILE)  # a reader never sees half a config
    except OSError as error:
        raise TitanliteError(f"job.dump_folder: cannot write the run folder under {parent}: {error.strerror}") from None
    return path


def start_run_dir(cfg: JobConfig) -> Path:
    """Rank 0 creates the run folder and every rank gets its path; a folder that cannot be
    written is the same one-line error on every rank, before the model is built."""
    return on_rank0(dist.group.WORLD if dist.is_initialized() else None, lambda: create_run_dir(cfg))


class MetricsFile:
    """`metrics.jsonl`, appended one object per line and flushed at once.

    Flushing hands each line to the operating system, so a crashed or killed process
    loses nothing it logged; the file is opened in append mode, so nothing is rewritten.
    """

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        # JSON has no NaN or infinity: a diverged loss is written as null
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self._file.write(json.dumps(finite) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a run folder's metrics.jsonl, in order. A last line cut short (the
    machine died mid-write) is left out; a broken line elsewhere is an error naming it."""
    path = Path(run_dir) / METRICS_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise TitanliteError(f"{path}: cannot read metrics ({error.strerror})") from None
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                raise TitanliteError(f"{path}:{number}: not a JSON object") from None
    return records
