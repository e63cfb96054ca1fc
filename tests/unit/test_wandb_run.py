"""metrics.enable_wandb (titanlite/observe/wandb_run.py through MetricsLogger), with W&B
offline: rank 0's scalars under TensorBoard's tags and steps, the config and the environment's
description of the run recorded, the run finished at close; other ranks never import wandb; a
missing package is one line and exit code 2 before any device is used. (Through the trainer on
two processes: tests/runs/test_metrics.py.)"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from tests.helpers.distributed import read_tensorboard
from tests.helpers.wandb_files import offline_wandb, read_offline_run
from titanlite.config import Metrics
from titanlite.errors import TitanliteError
from titanlite.observe.metrics import MetricsLogger, PeakFlops


def logger_in(tmp_path, rank: int = 0, run_config: dict | None = None) -> MetricsLogger:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True, exist_ok=True)
    return MetricsLogger(
        Metrics(enable_wandb=True),
        str(tmp_path),
        rank,
        torch.device("cpu"),
        flops_per_token=1e6,
        peak=PeakFlops(1e12, "test"),
        devices_per_replica=1,
        run_dir=run_dir,
        run_config=run_config,
    )


def test_wandb_gets_tensorboards_scalars_and_the_config_and_is_finished_at_close(tmp_path, monkeypatch):
    import wandb

    offline_wandb(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_PROJECT", "llama-small")
    monkeypatch.setenv("WANDB_RUN_NAME", "lr-sweep-3")
    monkeypatch.setenv("WANDB_RUN_TAGS", "cpu,debug")
    metrics = logger_in(
        tmp_path, run_config={"training": {"steps": 2, "lr": 3e-4}, "job": {"dump_folder": str(tmp_path)}}
    )
    metrics.add_tokens(256)
    metrics.log(1, loss=8.5, grad_norm=1.25, lr=1e-4, tokens_seen=512)
    metrics.log_skipped_steps(2, 1)
    metrics.log(2, loss=8.125, grad_norm=0.75, lr=2e-4, tokens_seen=1024)
    metrics.log_validation(2, loss=8.25, perplexity=math.exp(8.25))
    metrics.close()
    assert wandb.run is None  # finished
    wandb.teardown()  # waits for wandb's service to write the run file (at exit in a trainer process)

    run = read_offline_run(tmp_path / "runs" / "r" / "wandb")  # the run folder holds W&B's files
    assert (run.project, run.name, run.tags) == ("llama-small", "lr-sweep-3", ["cpu", "debug"])
    assert run.config == {"training": {"steps": 2, "lr": 3e-4}, "job": {"dump_folder": str(tmp_path)}}
    tensorboard = read_tensorboard(tmp_path / "tb")
    assert {"validation/loss", "skipped_steps", "mfu"} <= set(run.history) == set(tensorboard)
    for tag, points in tensorboard.items():  # TensorBoard keeps float32
        assert [(step, float(np.float32(value))) for step, value in run.history[tag]] == points, tag


def test_other_ranks_never_import_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails
    metrics = logger_in(tmp_path, rank=1)
    metrics.log(1, 1.0, 1.0, 1e-4, 64)
    metrics.close()


def test_what_wandb_refuses_is_one_line(tmp_path, monkeypatch):
    offline_wandb(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_RUN_ID", "a/b")
    with pytest.raises(TitanliteError, match=r"^metrics.enable_wandb: W&B refused the run: Run ID cannot contain"):
        logger_in(tmp_path)


def test_a_missing_wandb_is_one_line_and_exit_2_before_training(tmp_path, monkeypatch, capsys):
    from titanlite import train

    monkeypatch.setitem(sys.modules, "wandb", None)
    code = train.main(["--config", "debug_model", "--metrics.enable_wandb", "true", "--job.dump_folder", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "titanlite: error: metrics.enable_wandb: logging to Weights & Biases needs the wandb "
        "package: pip install wandb\n"
    )
    assert not any(tmp_path.iterdir())  # stopped before the run folder (or a device)


def test_a_wandb_that_fails_to_import_is_one_line_and_exit_2_before_training(tmp_path, monkeypatch, capsys):
    """An install that is found but raises at import (a dependency clash), simulated by a package
    named wandb first on the path: rank 0 imports it before any device, not after the model."""
    from titanlite import train

    broken = tmp_path / "site" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('cannot import name Message from protobuf')\n")
    monkeypatch.syspath_prepend(str(broken.parent))
    for name in [name for name in sys.modules if name == "wandb" or name.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    dump = tmp_path / "dump"
    code = train.main(["--config", "debug_model", "--metrics.enable_wandb", "true", "--job.dump_folder", str(dump)])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "titanlite: error: metrics.enable_wandb: the installed wandb package fails to import (ImportError: cannot "
        "import name Message from protobuf); reinstall it: pip install --force-reinstall wandb\n"
    )
    assert not dump.exists()  # stopped before the run folder (or a device)


def test_a_bad_wandb_mode_is_one_line_and_exit_2_before_training(tmp_path, monkeypatch, capsys):
    from titanlite import train

    monkeypatch.setenv("WANDB_MODE", "bogus")
    code = train.main(["--config", "debug_model", "--metrics.enable_wandb", "true", "--job.dump_folder", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "titanlite: error: metrics.enable_wandb: WANDB_MODE='bogus' is not one of wandb's modes (online, offline, "
        "disabled, shared, dryrun, run)\n"
    )
    assert not any(tmp_path.iterdir())
