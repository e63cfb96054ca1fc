#!/usr/bin/env bash
# The GPU check, one command on a machine with CUDA GPUs: bench/gpu_check.sh [--dry-run]
#
# Trains, in bf16 with torch.compile per block, on the built-in corpus and the bundled
# tokenizer (nothing to download):
#   1. the debug model on one GPU;
#   2. Llama 3.2 1B's shapes (flavor 1B; the bundled 4,096-token vocabulary, not 128,256) on one GPU;
#   3. the same 1B model with FSDP on every GPU;
#   4. the same 1B model with TP on every GPU;
#   5. the 1B model in float8 (model.converters = ["float8"], torchao: torch._scaled_mm on SM >= 8.9,
#      emulation below) on one GPU, tensorwise then rowwise; with FSDP on every GPU, gathering float8
#      with precomputed scales. Skipped, with a line, where torchao is not installed;
#   6. DeepSeek-V3 at torchtitan's debug shape (MLA: key head dim 192, value 128, which SDPA must
#      take without padding; 8 routed experts top-3 through torch's grouped matmul in bf16, groups
#      of any length) on one GPU; with expert parallelism 2 over FSDP's ranks on every GPU.
# Each run's own log lines are printed (rank 0): the start-up lines (dtype, model, mesh, peak)
# and its step lines with tps, mfu and peak memory (mem); the last step's line is the figure.
# Never a test dependency. Put its output in docs/performance.md.
#
#   STEPS      steps per run (default 30; the trainer logs every 10)
#   SEQ_LEN    sequence length of the 1B runs (default 2048; the debug model trains at 2048 too)
#   OUT        dump folders (default a new temporary folder)
#   PYTHON     the interpreter (default python3; run from the copied tree, no install needed)
#
# --dry-run: on any machine, validate every run's flags with the trainer's own config parsing
# and the dry-run planner (python -m titanlite.plan, a fake world of the same size) instead
# of training. Each run prints its header and the planner's last lines (its verdict); a run
# the planner refuses ends the script there, with its one-line error and a non-zero exit
# code. The test suite runs this (tests/runs/test_gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-30}
SEQ_LEN=${SEQ_LEN:-2048}
OUT=${OUT:-$(mktemp -d -t titanlite_gpu_check.XXXXXX)}
DRY_RUN=$([ "${1:-}" = "--dry-run" ] && echo 1 || echo 0)

if [ "$DRY_RUN" = 1 ]; then  # no torch import of its own: tests/runs/test_gpu_check.py runs it
    NGPU=${NGPU_FOR_DRY_RUN:-8}
else
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    if [ "$NGPU" -lt 1 ]; then
        echo "bench/gpu_check.sh: no CUDA GPU here (torch.cuda.device_count() = 0); --dry-run checks the flags" >&2
        exit 2
    fi
    "$PYTHON" -c "import torch; print(f'torch {torch.__version__}; {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}')"
fi

COMMON=(--config debug_model
        --training.steps "$STEPS" --training.mixed_precision_param bfloat16 --compile.enable true
        --metrics.log_freq 10 --metrics.enable_tensorboard false --checkpoint.enable_checkpoint false)
ONE_B=(--model.flavor 1B --training.seq_len "$SEQ_LEN" --training.local_batch_size 1)

# run NAME PROCESSES [overrides...]: one training run, its log lines as the trainer writes them.
run() {
    local name=$1 nproc=$2
    shift 2
    echo "=== $name: $nproc GPU(s)"
    if [ "$DRY_RUN" = 1 ]; then
        "$PYTHON" -m titanlite.plan --world-size "$nproc" "${COMMON[@]}" --job.dump_folder "$OUT/$name" "$@" | tail -n 3
        return
    fi
    "$PYTHON" -m titanlite.launch --standalone --nproc-per-node "$nproc" --local-ranks-filter 0 --role rank --tee 3 \
        -m titanlite.train "${COMMON[@]}" --job.dump_folder "$OUT/$name" "$@" 2>&1 \
        | grep -E "compute dtype|float8: |model |step +[0-9]+ " || { echo "=== $name failed: see $OUT/$name" >&2; return 1; }
}

run debug_1gpu 1 --training.seq_len 2048 --training.local_batch_size 8
run llama32_1b_1gpu 1 "${ONE_B[@]}"
if [ "$NGPU" -gt 1 ]; then
    run llama32_1b_fsdp "$NGPU" "${ONE_B[@]}"
    run llama32_1b_tp "$NGPU" "${ONE_B[@]}" --parallelism.tensor_parallel_degree "$NGPU"
fi
if [ "$DRY_RUN" = 1 ] || "$PYTHON" -c "import torchao.float8" 2>/dev/null; then
    run llama32_1b_float8_1gpu 1 "${ONE_B[@]}" --model.converters float8
    run llama32_1b_float8_rowwise_1gpu 1 "${ONE_B[@]}" --model.converters float8 --float8.recipe_name rowwise
    if [ "$NGPU" -gt 1 ]; then
        run llama32_1b_float8_fsdp "$NGPU" "${ONE_B[@]}" --model.converters float8 \
            --float8.enable_fsdp_float8_all_gather true --float8.precompute_float8_dynamic_scale_for_fsdp true
    fi
else
    echo "=== float8 runs skipped: torchao is not installed (pip install \"titanlite[float8]\")"
fi
DSV3=(--model.name deepseek_v3 --model.flavor torchtitan:debugmodel --training.seq_len "$SEQ_LEN" --training.local_batch_size 4)
run deepseek_v3_1gpu 1 "${DSV3[@]}"
if [ "$NGPU" -gt 1 ]; then
    run deepseek_v3_ep2 "$NGPU" "${DSV3[@]}" --parallelism.expert_parallel_degree 2
fi
echo "dump folders: $OUT"
