#!/usr/bin/env bash
# The whole test suite: ./run_tests.sh [pytest args]. Installs what is missing on first use.
set -euo pipefail
cd "$(dirname "$0")"
export TITANLITE_TESTS=1
source scripts/ensure_env.sh
exec "$PYTHON" -m pytest -q "$@"
