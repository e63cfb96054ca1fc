"""`bench/gpu_check.sh --dry-run`, what a GPU machine's session starts from: on this CPU machine
every run of the check passes the trainer's config parsing and the planner (a fake world of the
run's size), so the GPU check does not spend its device time on a flag typo."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers.commands import run_command
from tests.helpers.distributed import REPO, run_env

SCRIPT = REPO / "bench" / "gpu_check.sh"
DRY_RUN_TIMEOUT = 900  # nine planner processes: ~35 s of CPU, minutes on a loaded host


@pytest.mark.timeout(DRY_RUN_TIMEOUT + 60)
def test_the_dry_run_validates_every_run_of_the_gpu_check(tmp_path):
    runs = re.findall(r"^\s*run (\w+) ", SCRIPT.read_text(), re.MULTILINE)
    env = {**run_env(), "PYTHON": sys.executable, "OUT": str(tmp_path), "NGPU_FOR_DRY_RUN": "8"}
    run = run_command(["bash", str(SCRIPT), "--dry-run"], env, timeout=DRY_RUN_TIMEOUT)
    assert run.returncode == 0, run.describe()
    sections = re.split(r"^=== ", run.stdout, flags=re.MULTILINE)[1:]
    assert [section.split(":")[0] for section in sections] == runs and runs, run.describe()
    for section in sections:
        assert re.search(r"^verdict: fits", section, re.MULTILINE), section
