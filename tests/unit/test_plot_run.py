"""scripts/plot_run.py: two real runs -> one PNG whose plotted series are the runs' own
metrics, labelled apart; validation lines when a run has them; which extra to install.
(Real training runs, and the script as a command: tests/runs/test_plot_run.py.)"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import REPO
from titanlite.config import JobConfig, Metrics
from titanlite.errors import TitanliteError
from titanlite.observe.metrics import MetricsLogger, PeakFlops
from titanlite.observe.run_dir import create_run_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@functools.cache
def plot_run():
    """The script as a module (registered first: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("plot_run", REPO / "scripts" / "plot_run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def logged_run(dump_folder: Path, lr: float, validate_at: list[int]):
    """A run folder filled by the real MetricsLogger, training and validation records."""
    cfg = JobConfig()
    cfg.job.dump_folder, cfg.optimizer.lr = str(dump_folder), lr
    run_dir = create_run_dir(cfg)
    metrics = MetricsLogger(
        Metrics(enable_tensorboard=False),
        str(dump_folder),
        0,
        torch.device("cpu"),
        1e6,
        PeakFlops(1e12, "test"),
        1,
        run_dir,
    )
    for step in range(1, 5):
        metrics.add_tokens(128)
        metrics.log(step, 9.0 - step * lr * 100, 1.0, lr, 128 * step)
        if step in validate_at:
            metrics.log_validation(step, 9.5 - step * lr * 100, math.exp(9.5 - step * lr * 100))
    metrics.close()
    return run_dir


def test_validation_is_a_dashed_line_of_its_own_per_run(tmp_path):
    a = logged_run(tmp_path / "a", 1e-3, validate_at=[2, 4])
    b = logged_run(tmp_path / "b", 2e-3, validate_at=[4])

    series = plot_run().main([str(a), str(b), "-o", str(tmp_path / "v.png")])

    loss = [(line.run.rpartition(" ")[2], line.kind, line.steps) for line in series["loss"]]
    assert loss == [
        ("(lr=0.001)", "train", [1, 2, 3, 4]),
        ("(lr=0.001)", "validation", [2, 4]),
        ("(lr=0.002)", "train", [1, 2, 3, 4]),
        ("(lr=0.002)", "validation", [4]),
    ]
    assert [line.values for line in series["loss"] if line.kind == "validation"][1] == [9.5 - 4 * 0.2]
    assert (tmp_path / "v.png").read_bytes().startswith(PNG_MAGIC)


def test_without_matplotlib_it_says_which_extra_to_install(tmp_path, monkeypatch):
    run_dir = logged_run(tmp_path, 1e-3, validate_at=[])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(
        TitanliteError, match=r"needs matplotlib \(the optional extra 'plot'\): pip install -e \.\[plot\]"
    ):
        plot_run().main([str(run_dir), "-o", str(tmp_path / "x.png")])


def test_a_dump_folder_whose_newest_start_trained_nothing_plots_the_run_before_it(tmp_path):
    """A resume with no step left writes a run folder with an empty metrics.jsonl; plotting
    the dump folder takes the newest run that logged steps."""
    trained = logged_run(tmp_path, 1e-3, validate_at=[])
    idle = trained.parent / f"{trained.name}-later"  # a newer start time
    idle.mkdir()
    (idle / "metrics.jsonl").write_text("")
    assert plot_run().find_run(tmp_path) == trained
    series = plot_run().main([str(tmp_path), "-o", str(tmp_path / "p.png")])
    assert [line.steps for line in series["loss"]] == [[1, 2, 3, 4]]
