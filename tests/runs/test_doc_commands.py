"""The README's and docs' commands run as written, in the set-up's environment (what
`source .venv/bin/activate` gives: this interpreter): every `python -m titanlite.config`
line of a code block, as it stands. The other commands are run by the tests of what they
do (the planner's exact lines: test_plan.py; the examples with no arguments: test_examples.py;
the launcher's and run_train.sh's: test_launch.py), or need a user's data or GPUs."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers.distributed import REPO, run_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CHEAP = re.compile(r"^python -m titanlite\.config\b")


def block_commands() -> list[tuple[str, str]]:
    """(doc, command) of each cheap command line in a fenced code block, its comment cut."""
    found = []
    for doc in DOCS:
        inside = False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                inside = not inside
            elif inside and CHEAP.match(line.strip()):
                found.append((doc.name, line.split("  #")[0].strip()))
    return found


def test_the_docs_have_commands_to_run():
    assert block_commands(), "no python -m titanlite.config line in any code block"


@pytest.mark.parametrize("doc, command", block_commands())
def test_a_documented_command_runs_as_written(doc, command):
    argv = shlex.split(command)
    result = subprocess.run(
        [sys.executable, *argv[1:]], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{doc}: {command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
