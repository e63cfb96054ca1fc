"""The resume line names an expert-layout change: a MoE checkpoint saved at ep 2 (2 gloo
processes) and resumed at ep 1 (FSDP 2 alone) says both layouts, experts included, as it does
for a change of mesh. (That such a resume continues the run's losses: test_pipeline_context_resume.py.)"""

from __future__ import annotations

import pytest

from tests.helpers.commands import launch

MOE_RUN = [
    "--model.name",
    "qwen3",
    "--model.flavor",
    "debugmodel_moe",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.peak_flops",
    "1e11",  # no start-up matmul measurement
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.async_mode",
    "disabled",
    "--checkpoint.interval",
    "2",
]


@pytest.mark.timeout(400)
def test_a_resume_at_another_expert_layout_says_so(tmp_path):
    saved = launch(
        2,
        [
            *MOE_RUN,
            "--job.dump_folder",
            str(tmp_path),
            "--training.steps",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
        ],
    )
    assert saved.returncode == 0, saved.describe()
    resumed = launch(2, [*MOE_RUN, "--job.dump_folder", str(tmp_path), "--training.steps", "3"])
    assert resumed.returncode == 0, resumed.describe()
    assert (
        "at step 2 (" in resumed.stdout
        and "; saved at world size 2 (mesh dp_shard 2; experts efsdp 1 x ep 2), loaded at world size 2 (mesh "
        "dp_shard 2); data stream position"
        in resumed.stdout
    ), resumed.describe()
