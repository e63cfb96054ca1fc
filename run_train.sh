#!/usr/bin/env bash
# Train with torchrun: ./run_train.sh [--config NAME] [--section.key value ...]
#
#   NPROC         processes on this node (default: the number of GPUs, or 2 without GPUs)
#   NNODES        nodes (default 1); multi-node also needs RDZV_ENDPOINT=host:port on every node
#                 (c10d rendezvous numbers the nodes itself: no node rank to set)
#   MAX_RESTARTS  times the job restarts after a rank fails, resuming from the newest
#                 complete checkpoint (default 0)
#   LOG_RANK      local ranks whose output is shown (default 0; e.g. 0,1)
#
# With no --config it trains train_configs/debug_model.toml; --help lists every option.
# SIGTERM or SIGUSR1 to this script saves a checkpoint of the current step and exits 0;
# Ctrl-C stops at once. Installs what is missing on first use (see scripts/ensure_env.sh).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh

for arg in "$@"; do
    if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
        exec "$PYTHON" -m titanlite.config --help
    fi
done

# A whole number >= $3 in variable $1 (value $2), or one line and exit code 2.
require_count() {
    if ! [[ "$2" =~ ^[0-9]+$ ]] || [ "$2" -lt "$3" ]; then
        echo "titanlite: error: $1: expected a whole number >= $3 (got '$2')" >&2
        exit 2
    fi
}

if [ -z "${NPROC:-}" ]; then
    ngpu=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    NPROC=$([ "$ngpu" -gt 0 ] && echo "$ngpu" || echo 2)
fi
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
LOG_RANK=${LOG_RANK:-0}
require_count NPROC "$NPROC" 1
require_count NNODES "$NNODES" 1
require_count MAX_RESTARTS "$MAX_RESTARTS" 0
# LOG_RANK: local ranks whose output is shown; one that does not exist would show nothing at all.
IFS=',' read -ra shown_ranks <<< "$LOG_RANK"
for rank in "${shown_ranks[@]}"; do
    if ! [[ "$rank" =~ ^[0-9]+$ ]] || [ "$rank" -ge "$NPROC" ]; then
        echo "titanlite: error: LOG_RANK: no local rank '$rank' (NPROC=$NPROC: local ranks 0 to $((NPROC - 1)))" >&2
        exit 2
    fi
done
if [ "$NNODES" != 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
    # Without it each node would pick its own port and wait for the others forever.
    echo "titanlite: error: NNODES=$NNODES needs RDZV_ENDPOINT=host:port (the first node's address, the same on every node)" >&2
    exit 2
fi
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}

args=("$@")
case " ${args[*]:-} " in
    *" --config "* | *" --config="*) ;;
    *) args=(--config debug_model.toml "${args[@]}") ;;
esac

# CPU thread and allocator settings (cores split between the processes; glibc keeping freed blocks under 32 MiB, returning larger ones) come from titanlite.launch.
exec "$PYTHON" -m titanlite.launch \
    --nnodes "$NNODES" --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titanlite.train "${args[@]}"
