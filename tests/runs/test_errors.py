"""A config that does not load is refused with the one-line user error before torch is
imported: `titanlite.train.main` in a fresh interpreter (the one-process side of
titanlite/errors.py: tests/unit/test_errors.py). And a user error that only one rank meets,
or that every rank meets while rank 0 lags, ends with exactly one line from the launcher."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.commands import Run, run_command
from tests.helpers.distributed import REPO, run_env

CHECK_BEFORE_TORCH = """
import sys
from titanlite.train import main
code = main(["--config", "debug_model", "--training.steps", "ten"])
print(code, "torch" in sys.modules)
"""


def test_a_config_that_does_not_load_is_refused_before_torch_is_imported():
    result = subprocess.run(
        [sys.executable, "-c", CHECK_BEFORE_TORCH], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=60
    )
    assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr
    assert result.stderr == "titanlite: error: training.steps: expected an integer, got 'ten'\n"


# --- Errors that not every rank meets, through the launcher: exactly one line -------------------

SMALL = [
    "--config",
    "debug_model",
    "--training.steps",
    "2",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.peak_flops",
    "1e11",
]


def launch_with(nproc: int, argv: list[str], env: dict[str, str]) -> Run:
    command = [
        sys.executable,
        "-m",
        "titanlite.launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "titanlite.train",
        *argv,
    ]
    return run_command(command, {**run_env(), **env})


def error_lines(run) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("titanlite:")]


def test_a_data_error_only_rank_1_meets_is_one_line(tmp_path):
    """Out-of-vocabulary ids in the windows rank 1 reads at step 1 only (no shuffle: rank r
    reads global windows [r*B, (r+1)*B) of the stream): rank 0 never meets the error and
    waits in its first collective, so its launcher must print rank 1's line."""
    import numpy as np

    from tests.helpers.token_data import SHIPPED, write_corpus
    from titanlite.data.prepare import prepare
    from titanlite.data.sources import FilesSource
    from titanlite.data.tokenizers import Tokenizer

    write_corpus(tmp_path / "text", n=120)
    prepare(FilesSource(str(tmp_path / "text")), Tokenizer(str(SHIPPED)), tmp_path / "data", workers=1)
    shard = tmp_path / "data" / "shard-00000.bin"
    tokens = np.fromfile(shard, dtype="<u2")
    window, batch = 65, 2
    tokens[batch * window + 5] = 60_000  # in rank 1's first window, outside the 4,096-token vocabulary
    tokens.tofile(shard)
    run = launch_with(
        2,
        [
            *SMALL,
            "--training.dataset",
            "prepared",
            "--training.dataset_path",
            str(tmp_path / "data"),
            "--training.shuffle",
            "false",
            "--job.dump_folder",
            str(tmp_path / "out"),
        ],
        {},
    )
    lines = error_lines(run)
    assert run.returncode == 2 and len(lines) == 1, run.describe()
    assert (
        lines[0].startswith("titanlite: error: training.dataset_path: ") and "shard-00000.bin is corrupted" in lines[0]
    ), run.describe()


def test_a_user_error_with_rank_0_held_back_is_still_one_line(tmp_path):
    """Rank 0 starts 20 s late (a slow node); rank 1 meets the config error at once and
    exits. The launcher stops rank 0 before it could print, and prints rank 1's line."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(20)\n"
    )
    env = {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{run_env()['PYTHONPATH']}"}
    run = launch_with(2, [*SMALL, "--training.steps", "ten", "--job.dump_folder", str(tmp_path / "out")], env)
    assert run.returncode == 2 and error_lines(run) == [
        "titanlite: error: training.steps: expected an integer, got 'ten'"
    ], run.describe()
    assert run.seconds < 20, run.describe()
