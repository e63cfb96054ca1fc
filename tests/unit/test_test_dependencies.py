"""Under ./run_tests.sh a missing test dependency fails in one line (tests/conftest.py), and
scripts/ensure_env.sh checks every package of the test extra, so an old .venv gets new ones."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers.distributed import REPO


def test_a_missing_test_dependency_fails_in_one_line(tmp_path):
    (tmp_path / "test_needs.py").write_text(
        'import pytest\n\npytest.importorskip("torchft")\npytest.importorskip("no_such_package_here")\n\n\n'
        "def test_x():\n    pass\n"
    )
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    run = subprocess.run(command, cwd=REPO, env={"TITANLITE_TESTS": "1", "PATH": ""}, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if "no_such_package_here" in line]
    assert run.returncode != 0 and "skipped" not in run.stdout, run.stdout[-2000:]
    assert "test dependency no_such_package_here is missing: pip install -e '.[test]'" in lines[0], run.stdout
    assert "Traceback" not in run.stdout and "could not import" not in run.stdout, run.stdout


def test_ensure_env_checks_every_package_of_the_test_extra():
    """Each package of pyproject's test extra (by its import name) is in ensure_env.sh's list."""
    pyproject = (REPO / "pyproject.toml").read_text()
    extra = re.search(r"^test = \[(.*)\]", pyproject, re.MULTILINE)[1]
    names = {re.match(r'"([A-Za-z0-9_-]+)', item.strip())[1] for item in extra.split(",")}
    imports = {"pytest-timeout": "pytest_timeout", "pytest-xdist": "xdist", "megatron-core": "megatron"}
    checked = re.search(r"TITANLITE_TESTS:\+ ([^}]*)\}", (REPO / "scripts" / "ensure_env.sh").read_text())[1].split()
    assert {imports.get(name, name) for name in names} <= set(checked)
