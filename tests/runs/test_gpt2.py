"""GPT-2, the second registered model, trained by `python -m titanlite.train` on one process.
Its TP plan through the real trainer against one process (TP 2 with sequence parallelism,
FSDP 2 x TP 2) is a layout of the equivalence sessions: test_parallel_equivalence.py
(test_gpt2_tp2_matches_one_process) and test_parallel_equivalence_4ranks.py
(test_gpt2_fsdp2_tp2_matches_one_process)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers.distributed import REPO, run_env, timeout_scale

TIMEOUT_S = 120


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
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S * timeout_scale())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "model gpt2 debugmodel" in proc.stdout and re.search(r"step +3 ", proc.stdout)  # the step is right-aligned
