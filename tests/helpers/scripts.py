"""The scripts under scripts/ run in this process (their `main(argv)`), as the unit tests of
the conversions call them."""

from __future__ import annotations

import runpy
from collections.abc import Callable

from tests.helpers.distributed import REPO
from titanlite.logging import logger


def script_main(name: str) -> Callable[[list[str]], int]:
    """scripts/<name>'s `main`. A script sets the titanlite logger up as a command does
    (`init_logger`, a handler on this test's captured stdout); it is put back as found when
    `main` returns, so a later test's log lines do not go to a closed capture."""
    main = runpy.run_path(str(REPO / "scripts" / name), run_name="script")["main"]

    def run(argv: list[str]) -> int:
        handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
        try:
            return main(argv)
        finally:
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate

    return run
