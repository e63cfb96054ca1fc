"""The README's promises: its config reference is the generated one, and CI runs its test command."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _updater():
    spec = importlib.util.spec_from_file_location(
        "update_readme_reference", REPO / "scripts/update_readme_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_current():
    assert _updater().reference_block() in (REPO / "README.md").read_text(), (
        "README.md's config reference is stale: run python scripts/update_readme_reference.py"
    )


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "./run_tests.sh" in readme and "./run_train.sh" in readme
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert any("./run_tests.sh" in line for line in ci), ci
