"""The run folder: config.toml that reads back to the run's config, and metrics.jsonl with
one flushed record per logged step or validation, written by rank 0 only."""

from __future__ import annotations

import json
import math

import pytest
import torch

from titanlite.config import JobConfig, Metrics, load_config
from titanlite.errors import TitanliteError
from titanlite.observe.metrics import MetricsLogger, PeakFlops
from titanlite.observe.run_dir import CONFIG_FILE, METRICS_FILE, create_run_dir, read_metrics, start_run_dir

TRAIN_FIELDS = {"step", "loss", "grad_norm", "lr", "tps", "mfu", "memory_gib", "tokens_seen", "elapsed_s", "wall_time"}


def logger_in(run_dir, rank: int = 0, peak: float | None = 1e12) -> MetricsLogger:
    return MetricsLogger(Metrics(enable_tensorboard=False), str(run_dir.parent), rank, torch.device("cpu"),
                         flops_per_token=1e6, peak=PeakFlops(peak, "test"), devices_per_replica=1, run_dir=run_dir)


def test_config_toml_reads_back_to_the_config_used(tmp_path):
    argv = ["--config", "debug_model", "--optimizer.lr", "3e-4", "--lr_scheduler.decay_ratio", "none",
            "--parallelism.fsdp_shard_modules", "TransformerBlock,Attention", "--job.dump_folder", str(tmp_path)]
    cfg = load_config(argv)
    run_dir = create_run_dir(cfg)
    assert run_dir.parent == tmp_path / cfg.metrics.save_runs_folder
    assert load_config(["--config", str(run_dir / CONFIG_FILE)]) == cfg
    assert sorted(p.name for p in run_dir.iterdir()) == [CONFIG_FILE]  # no temporary file left


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    folders = {create_run_dir(cfg) for _ in range(3)}
    assert len(folders) == 3 and all((f / CONFIG_FILE).is_file() for f in folders)


def test_unwritable_dump_folder_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cfg = JobConfig()
    cfg.job.dump_folder = str(blocker)
    with pytest.raises(TitanliteError, match=r"^job\.dump_folder: cannot write the run folder under .*a_file/runs"):
        start_run_dir(cfg)  # no process group: rank 0 of 1


def test_each_record_is_on_disk_as_soon_as_it_is_logged(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    metrics = logger_in(run_dir)
    metrics.add_tokens(256)
    scalars = metrics.log(1, loss=8.5, grad_norm=1.25, lr=1e-4, tokens_seen=512)
    first = read_metrics(run_dir)  # read while the file is still open: flushed already
    metrics.log_validation(1, loss=8.25, perplexity=math.exp(8.25))
    metrics.log(2, loss=float("nan"), grad_norm=float("inf"), lr=2e-4, tokens_seen=1024)
    records = read_metrics(run_dir)
    metrics.close()

    assert first == records[:1]
    train, validation, diverged = records
    assert set(train) == TRAIN_FIELDS
    assert {k: train[k] for k in scalars} == pytest.approx(scalars)
    assert (train["step"], train["tokens_seen"], train["lr"]) == (1, 512, 1e-4)
    assert train["elapsed_s"] >= 0 and train["wall_time"] == pytest.approx(validation["wall_time"], abs=60)
    assert set(validation) == {"step", "validation_loss", "validation_perplexity", "elapsed_s", "wall_time"}
    assert (validation["step"], validation["validation_loss"]) == (1, 8.25)
    assert validation["validation_perplexity"] == pytest.approx(math.exp(8.25))
    assert diverged["loss"] is None and diverged["grad_norm"] is None  # JSON has no NaN: null
    for line in (run_dir / METRICS_FILE).read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))


def test_only_rank_0_writes_and_mfu_is_left_out_when_unknown(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    other_rank = logger_in(run_dir, rank=1)
    other_rank.log(1, 1.0, 1.0, 1e-4, 64)
    other_rank.close()
    assert not (run_dir / METRICS_FILE).exists()
    no_peak = logger_in(run_dir, peak=None)
    no_peak.log(1, 1.0, 1.0, 1e-4, 64)
    no_peak.close()
    assert "mfu" not in read_metrics(run_dir)[0]


def test_a_torn_last_line_is_skipped_and_a_broken_middle_line_is_an_error(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(TitanliteError, match=rf"{METRICS_FILE}:1: not a JSON object"):
        read_metrics(tmp_path)


def test_tokens_per_second_are_per_device_of_the_replica(tmp_path, monkeypatch):
    """A dp rank's tokens are shared by its tensor-, context- and pipeline-parallel ranks: tps
    per device divides by them (the trainer passes tp x cp x pp), so MFU holds for any layout."""
    import itertools

    from titanlite.observe import metrics as module

    clock = itertools.chain([0.0], itertools.repeat(2.0))  # built at 0 s, logged at 2 s
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    metrics = MetricsLogger(Metrics(enable_tensorboard=False), str(tmp_path), 1, torch.device("cpu"), flops_per_token=1e6,
                            peak=PeakFlops(1e9, "test"), devices_per_replica=8, run_dir=run_dir)
    metrics.add_tokens(1600)
    scalars = metrics.log(1, loss=1.0, grad_norm=1.0, lr=1e-4, tokens_seen=1600)
    assert scalars["tps"] == 1600 / 2.0 / 8 and scalars["mfu"] == 100 * 100 * 1e6 / 1e9
