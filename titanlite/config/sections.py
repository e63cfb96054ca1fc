"""The run configuration's sections: one dataclass per TOML section, and `JobConfig`, the whole.

These dataclasses are the only description of the options: `titanlite.config.engine` derives
parsing (from each field's type hint), the per-value checks (its `choices` and range), the
help text and the TOML output from them. Section and key names follow torchtitan where the
two overlap. Loading and the rules that combine several keys are in `load.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config.engine import option as _opt
from titanlite.config.fault_tolerance import FaultTolerance
from titanlite.config.float8 import Float8
from titanlite.config.optimizer import Optimizer

# training.steps' bound: a run of more steps cannot finish (see its help), so a number past it
# (10**20, a typo, a stand-in for "forever") is refused instead of training until killed.
MAX_STEPS = 10**9

# --------------------------------------------------------------------------------------
# The sections. Field order is the order of help_text and of the printed config.
# --------------------------------------------------------------------------------------


@dataclass
class Job:
    """Where outputs go and what the run is."""

    dump_folder: str = _opt("./outputs", "root folder for checkpoints, TensorBoard logs and traces", nonempty=True)
    description: str = _opt("", "free-text description of the run, for humans")
    print_config: bool = _opt(False, "log the resolved config at start")


@dataclass
class Model:
    """Which model to build and how to tokenize its input."""

    name: str = _opt("llama3", "model name in the registry (titanlite.models)", nonempty=True)
    flavor: str = _opt("debugmodel", "size preset of the model, e.g. debugmodel, 8B, 70B, 405B", nonempty=True)
    tokenizer_path: str = _opt(
        "assets/tokenizer/titanlite.model",
        "tokenizer model file (relative paths are from the working directory)",
        nonempty=True,
    )
    hf_assets_path: str = _opt(
        "",
        "torchtitan's key: a folder holding the tokenizer files (tokenizer.json, "
        "tokenizer.model or original/tokenizer.model); when set, the tokenizer is read from there "
        "instead of model.tokenizer_path",
    )
    attn_mask_type: str = _opt(
        "causal",
        "attention mask: causal (every earlier token of the window), or block_causal "
        "(only earlier tokens of the same document, as Llama 3 pretrained)",
        choices=("causal", "block_causal"),
    )
    converters: list[str] = _opt(
        [],
        "conversions before parallelism: float8 (torchao's float8 linears, set in [float8]; emulated on devices "
        "without float8 matmuls; torchtitan's quantize.linear.float8 is the same)",
    )


@dataclass
class LRScheduler:
    """Warmup-stable-decay learning-rate schedule."""

    warmup_steps: int = _opt(200, "steps of linear warmup from 0 to optimizer.lr", ge=0)
    decay_ratio: float | None = _opt(
        None,
        "fraction of the post-warmup steps spent decaying at the end (lr held "
        "stable before); none = decay over all steps after warmup",
        ge=0,
        le=1,
        special=None,
    )
    decay_type: str = _opt("linear", "shape of the decay", choices=("linear", "cosine"))
    lr_min: float = _opt(
        0.0, "lr at the end of decay, as a fraction of optimizer.lr (torchtitan's min_lr_factor)", ge=0, le=1
    )


@dataclass
class Training:
    """Data, batch shape, step count and numerics."""

    dataset: str = _opt(
        "builtin",
        "data: builtin (text that ships with Python) or files (local text), both prepared "
        "into token shards on first use; or prepared (written by python -m titanlite.data.prepare)",
        choices=("builtin", "files", "prepared"),
    )
    dataset_path: str = _opt(
        "",
        "files: a .txt/.jsonl/.parquet file or folder; prepared: a prepared folder, or "
        "several blended by weight as 'web:0.7,code:0.3'",
    )
    dataset_cache_dir: str = _opt(
        "",
        "where builtin and files data are prepared on first use; empty = "
        "$XDG_CACHE_HOME/titanlite/data or ~/.cache/titanlite/data",
    )
    verify_data: bool = _opt(
        False,
        "check each prepared shard against the CRC-32s in its manifest.json the first "
        "time this rank reads it (training and validation data): one extra read of each "
        "shard; a mismatch stops the run with one line naming the file",
    )
    shuffle: bool = _opt(True, "visit each epoch's windows in a shuffled order keyed by training.seed")
    local_batch_size: int = _opt(8, "sequences per microbatch on each data-parallel rank", gt=0)
    global_batch_size: int = _opt(
        -1,
        "sequences per optimizer step over all ranks; -1 = local_batch_size x dp degree; "
        "a larger multiple accumulates gradients",
        gt=0,
        special=-1,
    )
    seq_len: int = _opt(2048, "tokens per training sequence", gt=0)
    max_norm: float = _opt(1.0, "clip gradients to this total norm; 0 disables clipping", ge=0)
    steps: int = _opt(
        10000,
        "optimizer steps to train for (more cannot finish: 1e9 steps at 1 ms each, far below any real step, "
        "take 11.6 days)",
        gt=0,
        le=MAX_STEPS,
    )
    seed: int = _opt(42, "random seed for weight init and data order", ge=0)
    deterministic: bool = _opt(False, "use deterministic kernels (slower; for bitwise-reproducible runs)")
    mixed_precision_param: str = _opt(
        "auto",
        "compute dtype of forward/backward (FSDP mixed precision, or autocast "
        "without FSDP); auto = bfloat16 on GPUs of SM >= 8.0 and on CPUs with native bf16 "
        "matmuls (AVX512-BF16 or AMX), else float32 (from the hardware, never a timing)",
        choices=("auto", "float32", "bfloat16"),
    )
    mixed_precision_reduce: str = _opt(
        "float32", "dtype of gradient reduce-scatter/all-reduce", choices=("float32", "bfloat16")
    )
    enable_cpu_offload: bool = _opt(False, "keep sharded parameters, gradients and optimizer state in CPU memory")
    max_nan_skips: int = _opt(
        0,
        "steps whose loss or grad norm is inf/nan that may be skipped (no optimizer step) "
        "before the run stops; 0 = stop at the first",
        ge=0,
    )
    gc_freq: int = _opt(
        50,
        "run Python's garbage collector every this many steps, on every rank at the same step "
        "(automatic collection off while training), so no rank stalls the others alone; 0 = "
        "Python's automatic collection",
        ge=0,
    )


@dataclass
class Validation:
    """Validation loss and perplexity, on held-out data."""

    enable: bool = _opt(
        False, "compute validation loss and perplexity every validation.freq steps and at the last step"
    )
    freq: int = _opt(100, "validate every this many steps", gt=0)
    steps: int = _opt(
        10,
        "batches per validation (local_batch_size windows per dp rank each); -1 = every validation window",
        gt=0,
        special=-1,
    )
    dataset: str = _opt(
        "",
        "empty = the held-out split of the training data; else builtin, files or prepared, as training.dataset",
        choices=("", "builtin", "files", "prepared"),
    )
    dataset_path: str = _opt("", "with validation.dataset: as training.dataset_path")
    holdout_fraction: float = _opt(
        0.01,
        "with validation.dataset empty: the share of each training dataset's windows "
        "(its last ones) kept out of training for validation, even with validation off, so "
        "turning validation on never changes the training data",
        ge=0,
        lt=1,
    )


@dataclass
class Parallelism:
    """Mesh degrees and FSDP2 / tensor-parallel / pipeline-parallel options."""

    data_parallel_replicate_degree: int = _opt(
        1,
        "replicas of the model: HSDP's replicate dim, or with data_parallel_shard_degree 1 replicate-only (DDP-like)",
        ge=1,
    )
    data_parallel_shard_degree: int = _opt(
        -1, "ways FSDP2 shards the model; -1 = the remaining ranks", ge=1, special=-1
    )
    tensor_parallel_degree: int = _opt(1, "ways each layer is split by tensor parallelism", ge=1)
    enable_loss_parallel: bool = _opt(True, "with TP: compute the loss on vocab-sharded logits without gathering them")
    sequence_parallel: str = _opt(
        "auto",
        "with TP: shard the residual stream by sequence between blocks (on), keep it "
        "whole on every rank (off), or auto: on off the CPU (gloo has no native reduce-scatter)",
        choices=("auto", "on", "off"),
    )
    fsdp_reshard_after_forward: str = _opt(
        "default",
        "free gathered parameters after forward: default (all but the "
        "root), always, never (more memory, less communication), or a number k: "
        "keep them sharded over groups of k ranks (e.g. a node), k dividing the FSDP "
        "shards",
    )
    fsdp_prefetch_depth: int = _opt(
        0, "0 = FSDP2's implicit prefetch; N > 0 explicitly prefetches the next N blocks in forward and backward", ge=0
    )
    fsdp_shard_modules: list[str] = _opt(
        [], "module class names to fully_shard; empty = the model's transformer blocks"
    )
    context_parallel_degree: int = _opt(
        1,
        "ways each training window's sequence is split (keys and values "
        "all-gathered in attention; load-balanced for the causal mask)",
        ge=1,
    )
    expert_parallel_degree: int = _opt(
        1,
        "ways an MoE model's routed experts are split, over ranks borrowed from "
        "data_parallel_shard_degree x context_parallel_degree (tokens exchanged by "
        "all-to-all); it must divide both and the experts per layer",
        ge=1,
    )
    expert_tensor_parallel_degree: int = _opt(
        1,
        "1: an MoE layer's routed experts run whole on each tp rank; tensor_parallel_degree: "
        "each expert's weights split over the tp ranks (column-wise in, row-wise out)",
        ge=1,
    )
    pipeline_parallel_degree: int = _opt(
        1,
        "pipeline stages' ranks: the model split into consecutive stages, each on "
        "its own ranks (the outermost mesh dim)",
        ge=1,
    )
    pipeline_parallel_schedule: str = _opt(
        "1F1B",
        "pipeline schedule (torch's pipelining): one stage per rank (1F1B, "
        "GPipe), several (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble), or two "
        "in a V (ZBVZeroBubble, DualPipeV)",
        choices=(
            "1F1B",
            "GPipe",
            "Interleaved1F1B",
            "LoopedBFS",
            "InterleavedZeroBubble",
            "ZBVZeroBubble",
            "DualPipeV",
        ),
    )
    pipeline_parallel_microbatch_size: int = _opt(
        1, "sequences per pipeline microbatch; training.local_batch_size / this = microbatches per schedule step", gt=0
    )
    pipeline_parallel_layers_per_stage: int | None = _opt(
        None,
        "transformer blocks per stage (the embedding and the "
        "output count as the *_less_layers below); none = 1 stage per "
        "rank, or 2 for multi-stage schedules",
        gt=0,
        special=None,
    )
    pipeline_parallel_split_points: list[str] = _opt(
        [],
        "explicit stage boundaries, each the first block of a stage "
        "after the first: e.g. layers.3,layers.6 (3 stages); empty = "
        "balanced automatically",
    )
    pipeline_parallel_balance: str = _opt(
        "layers",
        "automatic split: 'layers' counts blocks, the embedding and the "
        "output as the *_less_layers below (torchtitan's rule); 'flops' weighs every "
        "block, the embedding and the output head by its training FLOPs per token "
        "and picks the split whose slowest stage is the cheapest",
        choices=("layers", "flops"),
    )
    pipeline_parallel_first_stage_less_layers: int = _opt(
        1, "automatic split: the first stage takes this many blocks fewer, for the embedding", ge=0
    )
    pipeline_parallel_last_stage_less_layers: int = _opt(
        1,
        "automatic split: the last stage takes this many blocks fewer, for the final norm, the output and the loss",
        ge=0,
    )


@dataclass
class Checkpoint:
    """Distributed checkpoints (DCP): saving, retention, resuming and export."""

    enable_checkpoint: bool = _opt(
        False, "save checkpoints and resume from the newest one (torchtitan's checkpoint.enable)"
    )
    folder: str = _opt("checkpoint", "checkpoint folder, under job.dump_folder", nonempty=True)
    interval: int = _opt(500, "save every this many steps (and at the last step)", gt=0)
    async_mode: str = _opt(
        "async",
        "disabled (blocking save), async (save in the background), or "
        "async_with_pinned_mem (faster staging through pinned memory)",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    keep_latest_k: int = _opt(10, "keep only the newest k checkpoints; 0 = keep all", ge=0)
    load_step: int = _opt(-1, "step to resume from; -1 = the newest complete checkpoint", ge=0, special=-1)
    model_weights_only: bool = _opt(
        False,
        "save only model weights (no optimizer, schedule or data state) at the last step "
        "(torchtitan's checkpoint.last_save_model_only)",
    )
    export_dtype: str = _opt("float32", "dtype of weights-only exports", choices=("float32", "bfloat16", "float16"))
    last_save_in_hf: bool = _opt(
        False,
        "also write the last step's model as a Hugging Face folder, <folder>/step-N-hf "
        "(sharded safetensors + index, config.json, the tokenizer; each rank writes its own "
        "shards), in export_dtype (torchtitan's checkpoint.last_save_in_hf)",
    )
    initial_load_path: str = _opt("", "checkpoint to initialize from when the checkpoint folder has none")
    initial_load_format: str = _opt(
        "dcp", "format of initial_load_path: dcp, or hf (Hugging Face safetensors)", choices=("dcp", "hf")
    )
    create_seed_checkpoint: bool = _opt(False, "write the initialized weights as step 0 and exit (run on 1 process)")


@dataclass
class ActivationCheckpoint:
    """Recompute activations in backward to save memory."""

    mode: str = _opt(
        "none", "which transformer blocks recompute their activations", choices=("none", "full", "selective")
    )
    selective_ac_option: str = _opt(
        "2",
        "with mode selective: a whole number k, recompute every k-th block; or op, "
        "recompute each block's cheap ops and keep its matmul outputs (every other one) and "
        "attention (torchtitan's per-op policy)",
    )


@dataclass
class Compile:
    """torch.compile."""

    enable: bool = _opt(False, "compile each transformer block with torch.compile")


@dataclass
class Metrics:
    """Step logging, TensorBoard, Weights & Biases and the run folder (config.toml, metrics.jsonl)."""

    log_freq: int = _opt(10, "log loss, throughput and memory every this many steps", gt=0)
    enable_tensorboard: bool = _opt(True, "write TensorBoard scalars under job.dump_folder/save_tb_folder")
    save_tb_folder: str = _opt("tb", "TensorBoard folder, under job.dump_folder", nonempty=True)
    rank_0_only: bool = _opt(True, "log (and write TensorBoard) only on rank 0")
    enable_wandb: bool = _opt(
        False,
        "log the same scalars and the config to Weights & Biases from rank 0 (pip install "
        "wandb); the W&B run from WANDB_PROJECT, WANDB_RUN_NAME, ... as in torchtitan",
    )
    peak_flops: float = _opt(
        0.0, "peak FLOP/s per device for MFU; 0 = the known-GPU table, or on CPU a matmul measured at start-up", ge=0
    )
    save_runs_folder: str = _opt(
        "runs",
        "run folders, under job.dump_folder: each start of the trainer writes "
        "<start time>/config.toml and metrics.jsonl there (rank 0)",
        nonempty=True,
    )


@dataclass
class Profiling:
    """torch.profiler traces and CUDA memory snapshots."""

    enable_profiling: bool = _opt(False, "record torch.profiler traces")
    save_traces_folder: str = _opt("profile_traces", "trace folder, under job.dump_folder", nonempty=True)
    profile_freq: int = _opt(10, "record one trace (and memory snapshot) every this many steps", gt=0)
    enable_memory_snapshot: bool = _opt(False, "record the CUDA allocator's history and dump snapshots (CUDA only)")
    save_memory_snapshot_folder: str = _opt(
        "memory_snapshot", "memory snapshot folder, under job.dump_folder", nonempty=True
    )


@dataclass
class Comm:
    """Process-group timeouts."""

    init_timeout_seconds: int = _opt(
        300, "timeout of collectives through start-up and the first step (every process group of the run)", gt=0
    )
    train_timeout_seconds: int = _opt(
        100, "timeout of collectives after the first step (every process group of the run)", gt=0
    )


@dataclass
class JobConfig:
    """The whole run configuration: one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
