"""GPT-2, the second registered model: sizes on meta, the fused-qkv head layout, and its
TP plan through the real trainer (gloo processes) against one process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers.distributed import EQUIVALENCE_ARGS, REPO, assert_same_curve, run_env, run_trainer_worker
from tests.unit.test_gpt2 import build_on_meta
from titanlite.models.gpt2 import gpt2_spec

TIMEOUT_S = 120


TRAINER_ARGS = EQUIVALENCE_ARGS + ["--model.name", "gpt2"]

# name: (processes, overrides). Global batch 8 = local_batch_size x dp; TP 2 everywhere.
TP_LAYOUTS = {
    "tp2": (
        2,
        [
            "--training.local_batch_size",
            "8",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.sequence_parallel",
            "on",
        ],
    ),  # the GPU default, checked on gloo
    "fsdp2_tp2": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2_one_process")
    args = TRAINER_ARGS + ["--training.local_batch_size", "8", "--job.dump_folder", str(folder)]
    return run_trainer_worker(1, args, folder / "out.json")


def tp_replicated_bytes() -> int:
    """fp32 bytes the GPT-2 TP plan leaves whole on every tp rank: the position table,
    the LayerNorms and the row-parallel (c_proj) biases."""
    model = build_on_meta(gpt2_spec.args_for("debugmodel", vocab_size=128))
    replicated = [
        p for name, p in model.named_parameters() if "wpe" in name or "ln_" in name or name.endswith("c_proj.bias")
    ]
    return sum(p.numel() for p in replicated) * 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_trainer_tp_layouts_match_one_process(layout, one_process, tmp_path):
    """The real trainer, fp32, same seed and global batch: TP 2 (loss parallel) and
    FSDP 2 x TP 2 give the 1-process losses and grad norms to 1e-5 relative over 5 AdamW
    steps with clipping (a wrong plan is off by 1e-4 or more), and each rank holds only
    its share of the weights, so the match is not a plan that did nothing."""
    nproc, overrides = TP_LAYOUTS[layout]
    result = run_trainer_worker(
        nproc, TRAINER_ARGS + overrides + ["--job.dump_folder", str(tmp_path)], tmp_path / "out.json"
    )
    reference = one_process["history"]
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert_same_curve(result["history"], reference, layout)

    tp, dp_shard = 2, nproc // 2
    replicated = tp_replicated_bytes()
    for sizes in result["ranks"]:
        expected = ((sizes["full_param_bytes"] - replicated) / tp + replicated) / dp_shard
        for kind, factor in (("param_bytes", 1), ("grad_bytes", 1), ("optim_bytes", 2)):  # AdamW: exp_avg, exp_avg_sq
            assert sizes[kind] == pytest.approx(factor * expected, rel=0.01), f"{kind} on a rank of {layout}"


def test_trainer_runs_gpt2(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "titanlite.train",
        "--config",
        "debug_model",
        "--model.name",
        "gpt2",
        "--training.steps",
        "3",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(tmp_path),
    ]
    env = run_env()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # one plain process
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "model gpt2 debugmodel" in proc.stdout and re.search(r"step +3 ", proc.stdout)  # the step is right-aligned
