#!/usr/bin/env bash
# Sourced by run_train.sh and run_tests.sh: pick a Python that has titanlite's dependencies,
# or make one. Sets $PYTHON.
#
# 1. $PYTHON (or python3) already importing torch, sentencepiece and tensorboard is used as
#    it is (a GPU machine with its own torch build), with the repo on PYTHONPATH.
# 2. Otherwise a virtual environment in .venv gets them: the CPU build torch==2.13.0 when
#    no NVIDIA GPU is present (a bare "torch" could pull a multi-GB CUDA build), then the
#    project itself with its test extra.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"

# run_tests.sh sets TITANLITE_TESTS=1: the test tools are then needed too.
# Found, not imported: importing datasets and transformers alone takes seconds.
modules="torch sentencepiece tensorboard numpy${TITANLITE_TESTS:+ pytest pytest_timeout xdist safetensors tiktoken tokenizers pyarrow matplotlib datasets transformers megatron wandb torchft torchao ruff peft trl}"
has_deps() {
    "$1" -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' \
        $modules >/dev/null 2>&1
}

if [ -x "$repo_root/.venv/bin/python" ] && has_deps "$repo_root/.venv/bin/python"; then
    PYTHON="$repo_root/.venv/bin/python"
elif has_deps "${PYTHON:-python3}"; then
    PYTHON="${PYTHON:-python3}"
else
    echo "titanlite: installing into $repo_root/.venv (one time)" >&2
    [ -x "$repo_root/.venv/bin/python" ] || python3 -m venv "$repo_root/.venv"
    PYTHON="$repo_root/.venv/bin/python"
    "$PYTHON" -m pip install -q --upgrade pip >/dev/null
    if ! command -v nvidia-smi >/dev/null 2>&1 && ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        "$PYTHON" -m pip install -q "torch==2.13.0"
    fi
    "$PYTHON" -m pip install -q -e "$repo_root[test]"
fi
export PYTHON
