"""titanlite/observe/metrics.py: metrics.jsonl gets one flushed record per logged step or
validation, written by rank 0 only, MFU left out when the peak is unknown, tokens/s per device of
the replica. (The run folder and reading metrics.jsonl back: test_run_dir.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from titanlite.config import Metrics
from titanlite.observe.metrics import MetricsLogger, PeakFlops
from titanlite.observe.run_dir import METRICS_FILE, read_metrics
from titanlite.step.experts import load_field

TRAIN_FIELDS = {"step", "loss", "grad_norm", "lr", "tps", "mfu", "memory_gib", "tokens_seen", "elapsed_s", "wall_time"}


def logger_in(run_dir, rank: int = 0, peak: float | None = 1e12) -> MetricsLogger:
    return MetricsLogger(
        Metrics(enable_tensorboard=False),
        str(run_dir.parent),
        rank,
        torch.device("cpu"),
        flops_per_token=1e6,
        peak=PeakFlops(peak, "test"),
        devices_per_replica=1,
        run_dir=run_dir,
    )


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


def test_tokens_per_second_are_per_device_of_the_replica(tmp_path, monkeypatch):
    """A dp rank's tokens are shared by its tensor-, context- and pipeline-parallel ranks: tps
    per device divides by them (the trainer passes tp x cp x pp), so MFU holds for any layout."""
    import itertools

    from titanlite.observe import metrics as module

    clock = itertools.chain([0.0], itertools.repeat(2.0))  # built at 0 s, logged at 2 s
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    metrics = MetricsLogger(
        Metrics(enable_tensorboard=False),
        str(tmp_path),
        1,
        torch.device("cpu"),
        flops_per_token=1e6,
        peak=PeakFlops(1e9, "test"),
        devices_per_replica=8,
        run_dir=run_dir,
    )
    metrics.add_tokens(1600)
    scalars = metrics.log(1, loss=1.0, grad_norm=1.0, lr=1e-4, tokens_seen=1600)
    assert scalars["tps"] == 1600 / 2.0 / 8 and scalars["mfu"] == 100 * 100 * 1e6 / 1e9


def test_a_model_with_moe_layers_logs_its_expert_load_and_a_dense_one_does_not(tmp_path, caplog):
    """The step line's `moe_load mean/max` field and metrics.jsonl's moe_load_mean and
    moe_load_max (TensorBoard and W&B take the same scalars), only when the trainer passes a load
    (`step/experts.load_field`: the expert balance's field of the step line)."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    metrics = logger_in(run_dir)
    with caplog.at_level("INFO", logger="titanlite"):
        metrics.log(1, loss=8.5, grad_norm=1.0, lr=1e-4, tokens_seen=512, fields=[load_field(1.2345, 1.5)])
        metrics.log(2, loss=8.4, grad_norm=1.0, lr=1e-4, tokens_seen=1024)
    metrics.close()
    moe, dense = read_metrics(run_dir)
    assert set(moe) == TRAIN_FIELDS | {"moe_load_mean", "moe_load_max"} and set(dense) == TRAIN_FIELDS
    assert (moe["moe_load_mean"], moe["moe_load_max"]) == (1.2345, 1.5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step")]
    assert lines[0].endswith("moe_load 1.23/1.50") and "moe_load" not in lines[1]
