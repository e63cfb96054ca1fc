"""scripts/plot_run.py: two real runs -> one PNG whose plotted series are the runs' own
metrics, labelled apart; validation lines when a run has them; one line when it cannot."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.commands import TEST_TIMEOUT, train_single_process
from tests.helpers.distributed import REPO, run_env
from tests.unit.test_plot_run import PNG_MAGIC, plot_run
from titanlite.observe.run_dir import read_metrics


def lines_by_run(series, panel: str) -> dict[str, tuple[str, list[int], list[float]]]:
    return {line.run: (line.kind, line.steps, line.values) for line in series[panel]}


@pytest.mark.timeout(2 * TEST_TIMEOUT)
def test_two_real_runs_become_one_png_with_both_runs_series(tmp_path):
    folders = {}
    for lr in ("1e-3", "3e-3"):
        run = train_single_process(
            [
                "--config",
                "debug_model",
                "--training.steps",
                "3",
                "--training.seq_len",
                "64",
                "--training.local_batch_size",
                "2",
                "--metrics.log_freq",
                "1",
                "--optimizer.lr",
                lr,
                "--metrics.enable_tensorboard",
                "false",
                "--job.dump_folder",
                str(tmp_path / f"lr{lr}"),
            ]
        )
        assert run.returncode == 0, run.describe()
        folders[lr] = tmp_path / f"lr{lr}"
    out = tmp_path / "plots" / "compare.png"

    series = plot_run().main([str(folders["1e-3"]), str(folders["3e-3"]), "-o", str(out)])  # dump folders: newest run

    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 10_000
    assert set(series) == {"loss", "throughput", "memory"}
    for lr, folder in folders.items():
        (run_dir,) = (folder / "runs").iterdir()
        records = read_metrics(run_dir)
        for panel, key in (("loss", "loss"), ("throughput", "tps"), ("memory", "memory_gib")):
            by_run = lines_by_run(series, panel)
            (label,) = [name for name in by_run if f"lr={float(lr)}" in name]
            assert by_run[label] == ("train", [1, 2, 3], [r[key] for r in records]), (panel, label)
    assert len(lines_by_run(series, "loss")) == 2  # no validation in these runs: no such lines


def test_a_folder_without_runs_is_one_line_and_exit_code_2(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plot_run.py"), str(tmp_path)],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip() == f"titanlite: error: {tmp_path}: no metrics.jsonl here or in the run folders below it"
    )
