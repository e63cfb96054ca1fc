"""Tests are marked by where they live: everything under tests/runs/ starts processes or
trains through the trainer and is `slow`, so a quick subset (`./run_tests.sh -m "not slow"`,
tests/unit/ alone) runs in a minute or two while working. Helpers sit in tests/helpers/."""

from pathlib import Path

import pytest

RUNS = Path(__file__).parent / "runs"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if RUNS in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.slow)
