#!/usr/bin/env bash
# The whole test suite: ./run_tests.sh [pytest args]. Installs what is missing on first use.
set -euo pipefail
cd "$(dirname "$0")"
export TITANLITE_TESTS=1
source scripts/ensure_env.sh
# Lint and format first (ruff, pinned in the test extra; settings in pyproject.toml): a lint
# error or an unformatted file fails the run before any test starts. `ruff format .` fixes the latter.
"$PYTHON" -m ruff check --quiet .
"$PYTHON" -m ruff format --check --quiet . || {
    echo "titanlite: the files above are not formatted: run '$PYTHON -m ruff format .'" >&2
    exit 1
}
# Two workers by default (TITANLITE_TEST_WORKERS; 0 = in this process), each taking whole
# files so a module's fixtures run once: most tests start processes that spend their first
# seconds importing and rendezvousing, which two at a time overlap on two cores. (A third
# worker measured 1,262 s against two's 1,308 s on one host, but on a slower one stretched a
# 2-rank session past its 420 s hang guard: the guards are sized for two.) The files go
# out in the collection's order, the longest first (tests/conftest.py).
exec "$PYTHON" -m pytest -q -n "${TITANLITE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
