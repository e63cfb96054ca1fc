"""Rewrite README.md's config reference from the config dataclasses (`--help` output).

    python scripts/update_readme_reference.py

The reference has one source, `titanlite.config.help_text()`; tests/unit/test_readme.py fails
when the README copy drifts from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.config import help_text  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def reference_block() -> str:
    return f"{START}\n```text\n{help_text()}\n```\n{END}"


def main() -> None:
    text = README.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + reference_block() + tail)


if __name__ == "__main__":
    main()
