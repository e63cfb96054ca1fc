"""The run configuration: `JobConfig`, one dataclass per TOML section, and the sections of what
the run is (job, model, learning-rate schedule, training data and numerics, validation).

These dataclasses are the only description of the options: the generic engine derives parsing
(`parse.py`, from each field's type hint), the per-value checks (`engine.py`, from its `choices`
and range), the help text and the TOML output (`output.py`) from them. The other sections have
a module per concern: `optimizer.py`, `parallelism.py` (how a step runs across ranks),
`records.py` (checkpoints, metrics, traces), `float8.py`, `fault_tolerance.py`. Section and key
names follow torchtitan where the two overlap. Loading and the rules that combine several keys
are in `load.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config.engine import option as _opt
from titanlite.config.fault_tolerance import FaultTolerance
from titanlite.config.float8 import Float8
from titanlite.config.lora import LoRA
from titanlite.config.optimizer import Optimizer
from titanlite.config.parallelism import ActivationCheckpoint, Comm, Compile, Parallelism
from titanlite.config.records import Checkpoint, Metrics, Profiling
from titanlite.config.sft import SFT

# training.steps' bound: a run of more steps cannot finish (see its help), so a number past it
# (10**20, a typo, a stand-in for "forever") is refused instead of training until killed.
MAX_STEPS = 10**9

# Field order, and JobConfig's order of sections, is the order of help_text and of the printed config.


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
    flavor: str = _opt(
        "debugmodel",
        "size preset of the model, e.g. debugmodel, 8B, 70B, 405B; hf: the shape of model.hf_assets_path's config.json",
        nonempty=True,
    )
    tokenizer_path: str = _opt(
        "assets/tokenizer/titanlite.model",
        "tokenizer model file (relative paths are from the working directory)",
        nonempty=True,
    )
    hf_assets_path: str = _opt(
        "",
        "torchtitan's key: a folder holding the tokenizer files (tokenizer.json, tokenizer.model or "
        "original/tokenizer.model); when set, the tokenizer is read from there instead of model.tokenizer_path",
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
        "without float8 matmuls; torchtitan's quantize.linear.float8 is the same); lora (adapters on a frozen "
        "model, set in [lora])",
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
        "into token shards on first use; or prepared (written by python -m titanlite.data.prepare); "
        "or chat (conversations, prepared on first use as [sft] says)",
        choices=("builtin", "files", "prepared", "chat"),
    )
    dataset_path: str = _opt(
        "",
        "files: a .txt/.jsonl/.parquet file or folder; prepared: a prepared folder, or "
        "several blended by weight as 'web:0.7,code:0.3'; chat: a .jsonl file or folder",
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
    mtp_loss_weight: float = _opt(
        0.3,
        "with a model's multi-token prediction modules (DeepSeek-V3's num_nextn_predict_layers): the loss is the "
        "main loss plus this times the mean of the depths' losses (DeepSeek-V3 trained with 0.3, then 0.1)",
        ge=0,
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
        "run Python's garbage collector every this many steps, on every rank at the same step (automatic collection "
        "off while training), so no rank stalls the others alone; 0 = Python's automatic collection",
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
        "with validation.dataset empty: the share of each training dataset's windows (its last ones) kept out of "
        "training for validation, even with validation off, so turning validation on never changes the training data",
        ge=0,
        lt=1,
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
    lora: LoRA = field(default_factory=LoRA)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    sft: SFT = field(default_factory=SFT)
