"""A config that does not load is refused with the one-line user error before torch is
imported: `titanlite.train.main` in a fresh interpreter (the one-process side of
titanlite/errors.py: tests/unit/test_errors.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.distributed import REPO, run_env

CHECK_BEFORE_TORCH = """
import sys
from titanlite.train import main
code = main(["--config", "debug_model", "--training.steps", "ten"])
print(code, "torch" in sys.modules)
"""


def test_a_config_that_does_not_load_is_refused_before_torch_is_imported():
    result = subprocess.run([sys.executable, "-c", CHECK_BEFORE_TORCH], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr
    assert result.stderr == "titanlite: error: training.steps: expected an integer, got 'ten'\n"
