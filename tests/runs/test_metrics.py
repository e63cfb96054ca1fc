"""The run folder: config.toml that reads back to the run's config, and metrics.jsonl with
one flushed record per logged step or validation, written by rank 0 only; with
metrics.enable_wandb (offline), rank 0's W&B run beside them, holding TensorBoard's scalars and
the config."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from tests.helpers.commands import TEST_TIMEOUT, launch, printed_tolerance, printed_value, step_lines
from tests.helpers.distributed import read_tensorboard
from tests.helpers.wandb_files import offline_wandb, read_offline_run
from tests.unit.test_metrics import TRAIN_FIELDS
from titanlite.config import load_config, to_dict
from titanlite.observe.run_dir import CONFIG_FILE, METRICS_FILE, read_metrics


@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_process_run_leaves_one_run_folder_matching_the_console(tmp_path, monkeypatch):
    """Rank 0 alone writes the run folder; its records are the printed step lines; the
    config it saved (overrides applied) reads back to the run's config; TensorBoard's
    folder has the same name; the last line sums the run up and says where its checkpoint and
    metrics are; the W&B run (rank 0's only, in the run folder) holds
    TensorBoard's scalars at the same steps and that config."""
    offline_wandb(monkeypatch, tmp_path)
    argv = [
        "--config",
        "debug_model",
        "--training.steps",
        "3",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "2",
        "--optimizer.lr",
        "5e-4",
        "--metrics.enable_wandb",
        "true",
        "--checkpoint.enable_checkpoint",
        "true",
        "--job.dump_folder",
        str(tmp_path),
    ]
    run = launch(2, argv)
    assert run.returncode == 0, run.describe()

    (run_dir,) = (tmp_path / "runs").iterdir()
    assert sorted(os.listdir(run_dir)) == [CONFIG_FILE, METRICS_FILE, "wandb"]
    # The saved config is the one used: "auto" compute dtype as decided on this host.
    used = re.search(r"compute dtype (\w+) \(auto", run.stdout + run.stderr).group(1)
    saved = load_config(["--config", str(run_dir / CONFIG_FILE)])
    assert saved == load_config([*argv, "--training.mixed_precision_param", used])
    assert [p.name for p in (tmp_path / "tb").iterdir()] == [run_dir.name]

    assert len(list(tmp_path.rglob("*.wandb"))) == 1  # rank 0's run only
    wandb_run = read_offline_run(run_dir / "wandb")
    assert wandb_run.config == json.loads(json.dumps(to_dict(saved)))
    tensorboard = read_tensorboard(tmp_path / "tb")
    assert set(wandb_run.history) == set(tensorboard)
    for tag, points in tensorboard.items():  # TensorBoard keeps float32
        assert [(step, float(np.float32(value))) for step, value in wandb_run.history[tag]] == points, tag

    records = read_metrics(run_dir)
    lines = step_lines(run)
    assert [r["step"] for r in records] == [int(m["step"]) for m in lines] == [1, 2, 3]
    for record, match in zip(records, lines):
        assert set(record) == TRAIN_FIELDS
        for printed, key in (("loss", "loss"), ("grad_norm", "grad_norm"), ("lr", "lr"), ("tps", "tps")):
            assert abs(record[key] - printed_value(match[printed])) <= printed_tolerance(match[printed]) * 1.001
    # 2 data-parallel ranks x 2 sequences x 64 tokens per step
    assert [r["tokens_seen"] for r in records] == [256, 512, 768]
    assert records[0]["elapsed_s"] <= records[1]["elapsed_s"] <= records[2]["elapsed_s"]

    (summary,) = [line for line in run.output.splitlines() if "done: " in line]
    found = re.search(
        r"done: 3 steps, 768 tokens in ([\d.]+) s; final loss ([\d.]+); peak mem ([\d.]+) GiB; "
        r"checkpoint (\S+); metrics (\S+)$",
        summary,
    )
    assert found, summary
    seconds, loss, memory, checkpoint, metrics = found.groups()
    assert float(seconds) > 0
    assert float(loss) == pytest.approx(records[-1]["loss"], abs=5e-5)
    assert float(memory) >= records[-1]["memory_gib"] - 0.005
    assert checkpoint == str(tmp_path / "checkpoint" / "step-3") and (tmp_path / "checkpoint" / "step-3").is_dir()
    assert metrics == str(run_dir / METRICS_FILE)
