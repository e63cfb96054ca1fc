"""The trainer's command line: `python -m titanlite.train --config debug_model.toml [--section.key value ...]`.

The config is loaded and checked first, before torch and the trainer (`trainer.py`) are
imported: a mistyped key or value is one line and exit code 2 in a fraction of a second
instead of after seconds of imports on every rank. A worker the launcher binds to its
cores (`--cpu-bind`) binds here too, before torch starts any thread.
"""

from __future__ import annotations

import sys

from titanlite.config import load_config
from titanlite.runtime.cpu_binding import bind_from_env
from titanlite.errors import TitanliteError, report_user_error, say_notices


def main(argv: list[str] | None = None) -> int:
    notices: list[str] = []
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv, notices)
    except TitanliteError as error:
        return report_user_error(error)
    say_notices(notices)
    bind_from_env()  # before torch starts a thread (`titanlite.launch --cpu-bind`)
    from titanlite.trainer import run_checked  # torch and everything it builds

    return run_checked(cfg)


if __name__ == "__main__":
    sys.exit(main())
