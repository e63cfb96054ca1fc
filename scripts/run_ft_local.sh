#!/usr/bin/env bash
# Fault-tolerant training on one host: a torchft lighthouse and GROUPS replica groups of
# PROCS processes each, every group its own titanlite.launch (torchrun) job (docs/faults.md).
#
#   scripts/run_ft_local.sh GROUPS PROCS [titanlite.train args...]
#   scripts/run_ft_local.sh 2 2 --config debug_model --training.steps 50
#
# Environment: LIGHTHOUSE_PORT (29510), MIN_REPLICAS (1: the lighthouse forms a quorum of one
# group; the trainer's fault_tolerance.min_replica_size decides whether a step commits),
# TORCHFT_LIGHTHOUSE (an address: use that lighthouse instead of starting one here).
# Group g logs to $LOG_DIR/replica_<g>.log (LOG_DIR: ./outputs/ft_logs); a killed group is
# started again by hand with the same line (printed below), and heals from a live group.
# Exit status: 0 when the groups that were not killed finished (a killed group is one line, not
# a failure); else the status of a group that failed on its own.
set -euo pipefail

if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ || ! $2 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 GROUPS PROCS [titanlite.train args...] (GROUPS and PROCS whole numbers >= 1)" >&2
    exit 2
fi
groups=$1 procs=$2
shift 2
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
[[ -x .venv/bin/python && -z ${PYTHON:-} ]] && python=.venv/bin/python
lighthouse_bin=$(dirname "$python")/torchft_lighthouse
command -v "$lighthouse_bin" >/dev/null || lighthouse_bin=torchft_lighthouse
if ! command -v "$lighthouse_bin" >/dev/null; then
    echo "$0: torchft is not installed (no torchft_lighthouse): pip install 'titanlite[ft]'" >&2
    exit 2
fi
log_dir=${LOG_DIR:-./outputs/ft_logs}
mkdir -p "$log_dir"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

if [[ -z ${TORCHFT_LIGHTHOUSE:-} ]]; then
    port=${LIGHTHOUSE_PORT:-29510}
    RUST_LOG=${RUST_LOG:-warn} "$lighthouse_bin" --min_replicas "${MIN_REPLICAS:-1}" --bind "[::]:$port" \
        >"$log_dir/lighthouse.log" 2>&1 &
    pids+=($!)
    export TORCHFT_LIGHTHOUSE=http://localhost:$port
    sleep 0.5
    kill -0 "${pids[0]}" 2>/dev/null || { echo "$0: the lighthouse did not start: $(tail -1 "$log_dir/lighthouse.log")" >&2; exit 1; }
fi

group_pids=()
for ((g = 0; g < groups; g++)); do
    line=("$python" -m titanlite.launch --standalone --nproc-per-node "$procs" -m titanlite.train "$@"
        --fault_tolerance.enable true --fault_tolerance.group_size "$groups" --fault_tolerance.replica_id "$g")
    "${line[@]}" >"$log_dir/replica_$g.log" 2>&1 &
    group_pids+=($!)
    echo "replica group $g (pid $!): ${line[*]} > $log_dir/replica_$g.log"
done
pids+=("${group_pids[@]}")

# The job finished when a group finished (exit 0). A group killed by a signal (its launcher: exit
# status above 128; a worker: its launcher's line "killed by signal") was lost, as fault tolerance
# allows: one line, and not the job's status. A group that failed on its own error is the job's.
status=0 finished=0
for g in "${!group_pids[@]}"; do
    if wait "${group_pids[$g]}"; then finished=1; continue; else code=$?; fi
    if ((code > 128)) || tail -n 3 "$log_dir/replica_$g.log" | grep -q "killed by signal"; then
        echo "$0: replica group $g was killed (exit status $code); the job went on without it" >&2
        lost=$code
    else
        status=$code
    fi
done
((finished || status)) || status=${lost:-1}
exit "$status"
