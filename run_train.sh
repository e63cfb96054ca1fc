#!/usr/bin/env bash
# Train with torchrun: ./run_train.sh [--config NAME] [--section.key value ...]
#
#   NPROC     processes on this node (default: the number of GPUs, or 2 without GPUs)
#   NNODES    nodes (default 1); multi-node also needs RDZV_ENDPOINT=host:port on every node
#   LOG_RANK  local ranks whose output is shown (default 0; e.g. 0,1)
#
# With no --config it trains train_configs/debug_model.toml. Installs what is missing
# on first use (see scripts/ensure_env.sh).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh

if [ -z "${NPROC:-}" ]; then
    ngpu=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    NPROC=$([ "$ngpu" -gt 0 ] && echo "$ngpu" || echo 2)
fi
NNODES=${NNODES:-1}
LOG_RANK=${LOG_RANK:-0}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}

args=("$@")
case " ${args[*]:-} " in
    *" --config "* | *" --config="*) ;;
    *) args=(--config debug_model.toml "${args[@]}") ;;
esac

# CPU thread settings (cores split between the processes) come from titanlite.launch.
exec "$PYTHON" -m titanlite.launch \
    --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titanlite.train "${args[@]}"
