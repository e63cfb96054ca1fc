"""Helpers that start real multi-process gloo runs with a hard timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("trainer_worker.py")


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def with_overrides(*lists: list[str] | tuple[str, ...]) -> list[str]:
    """`--key value` pairs of several lists, a later list's value replacing an earlier one's
    (the command line itself refuses a key given twice)."""
    merged: dict[str, str] = {}
    for words in lists:
        merged.update(zip(words[::2], words[1::2]))
    return [word for pair in merged.items() for word in pair]


def torchrun(nproc: int, module_or_script: list[str], args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`python -m titanlite.launch --standalone --nproc-per-node N ...`; a hang fails the test."""
    cmd = [sys.executable, "-m", "titanlite.launch", "--standalone", f"--nproc-per-node={nproc}", *module_or_script, *args]
    return subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout)


def run_trainer_worker(nproc: int, args: list[str], out: Path, timeout: float = 240) -> dict:
    """Train with `args` (`--key value` pairs, a later one replacing an earlier) on `nproc`
    processes; returns the worker's JSON (history, per-rank bytes)."""
    result = torchrun(nproc, [str(WORKER), str(out)], with_overrides(args), timeout)
    if result.returncode != 0:
        raise AssertionError(f"trainer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return json.loads(out.read_text())


# The fp32 recipe under which every parallel layout must reproduce one process's curve.
EQUIVALENCE_STEPS = 5
EQUIVALENCE_ARGS = [
    "--config", "debug_model",
    "--training.steps", str(EQUIVALENCE_STEPS),
    "--training.seq_len", "64",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "3e-3",
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false",
]  # fmt: skip


def assert_same_curve(history: list[dict], reference: list[dict], label: str, rel: float = 1e-5) -> None:
    """Every step of an EQUIVALENCE_ARGS run logged, with loss and grad norm as the reference's."""
    assert [h["step"] for h in history] == list(range(1, EQUIVALENCE_STEPS + 1))
    for ours, ref in zip(history, reference):
        for key in ("loss", "grad_norm"):
            assert ours[key] == pytest.approx(ref[key], rel=rel), f"{label} step {ref['step']} {key}: {ours[key]} vs {ref[key]}"


def read_tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the (single) run under `folder`, as (step, value) lists."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted(p.parent for p in folder.rglob("events.out.tfevents.*"))
    assert runs, f"no TensorBoard event files under {folder}"
    accumulator = EventAccumulator(str(runs[-1]))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
