"""`training.mixed_precision_param = "auto"` (issue: throughput, item 4): bf16 only where it is
native (whatever the host's load), float32 elsewhere, one decision for every rank, said once.

The decision rule is checked with the host's answers stood in (this CI's CPU has no bf16
units, and no test may need a GPU); the 2-process run checks what this host really picks
and that rank 0 says it once. bf16's numerics against float32 are tests/runs/test_mixed_precision.py's.
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks
from titanlite.step import precision


@pytest.mark.timeout(300)
def test_the_trainer_resolves_auto_once_for_all_ranks(tmp_path):
    args = [
        "--config",
        "debug_model",
        "--training.steps",
        "1",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--job.dump_folder",
        str(tmp_path),
    ]
    result = run_ranks(2, ["-m", "titanlite.train"], args, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "compute dtype" in line]
    assert len(lines) == 1 and "(auto: " in lines[0], lines
    expected = "bfloat16" if precision.cpu_has_native_bf16() else "float32"  # the hardware's answer, never a timing
    assert f"compute dtype {expected} " in lines[0], lines
