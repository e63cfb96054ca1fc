"""Tests are marked by where they live: everything under tests/runs/ starts processes or
trains through the trainer and is `slow`, so a quick subset (`./run_tests.sh -m "not slow"`,
tests/unit/ alone) runs in a minute or two while working. Helpers sit in tests/helpers/.

The longest files run first. run_tests.sh gives each xdist worker whole files (`--dist
loadfile`) in the collection's order (`--no-loadscope-reorder`; xdist's own order, by the
number of tests in a file, started the few-test, many-process files last, and the last file
to start set the end of the run); with the long files first, the short ones fill in at the
end and both workers finish together."""

from pathlib import Path

import pytest

RUNS = Path(__file__).parent / "runs"
# Seconds a file took in a full run (./run_tests.sh --durations=0, setup + call + teardown
# of its tests; measured on a loaded host, so only the order matters). A file not listed
# (seconds or less) keeps its place after these.
FILE_SECONDS = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if RUNS in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.slow)
    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=lambda item: -FILE_SECONDS.get(Path(str(item.path)).as_posix().rpartition("/tests/")[2], 0))
