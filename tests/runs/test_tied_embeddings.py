"""Tied embeddings (one table for lookup and head, as Llama 3.2 has) through every layer:
the model, the Llama 3.2 flavors, the Hugging Face names, the TP plan with FSDP, and DCP
checkpoints (issue: throughput, item 6)."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import EQUIVALENCE_ARGS, assert_same_curve, run_trainer_worker

TIED = ["--model.flavor", "debugmodel_tied"]
FSDP2_TP2 = ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]


@pytest.mark.timeout(600)
def test_tied_fsdp_tp_matches_single_process(tmp_path):
    reference = run_trainer_worker(
        1,
        EQUIVALENCE_ARGS + TIED + ["--training.local_batch_size", "8", "--job.dump_folder", str(tmp_path / "one")],
        tmp_path / "one.json",
    )
    result = run_trainer_worker(
        4, EQUIVALENCE_ARGS + TIED + FSDP2_TP2 + ["--job.dump_folder", str(tmp_path / "tp")], tmp_path / "tp.json"
    )
    assert reference["history"][-1]["loss"] < reference["history"][0]["loss"]
    assert_same_curve(result["history"], reference["history"], "tied fsdp2_tp2")


@pytest.mark.timeout(600)
def test_tied_checkpoint_resumes_exactly(tmp_path):
    """Steps 1-5 straight against 1-2, a (blocking, last-step) checkpoint, then 3-5 resumed.
    Constant lr after warmup, so the run told to stop at 2 has the 5-step run's schedule."""
    checkpoint = [
        "--checkpoint.enable_checkpoint",
        "true",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.interval",
        "2",
        "--lr_scheduler.decay_ratio",
        "0",
    ]
    common = EQUIVALENCE_ARGS + TIED + FSDP2_TP2 + checkpoint
    straight = run_trainer_worker(
        4, common + ["--job.dump_folder", str(tmp_path / "straight")], tmp_path / "straight.json"
    )
    first = common + ["--job.dump_folder", str(tmp_path / "resumed")]
    run_trainer_worker(4, first + ["--training.steps", "2"], tmp_path / "first.json")
    resumed = run_trainer_worker(4, first, tmp_path / "resumed.json")
    assert [h["step"] for h in resumed["history"]] == [3, 4, 5]
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"][2:]]
