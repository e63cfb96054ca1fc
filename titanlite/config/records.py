"""The sections of what a run keeps: distributed checkpoints (`Checkpoint`), step metrics and the
run folder (`Metrics`), profiler traces and memory snapshots (`Profiling`); `sections.JobConfig`
holds them, each folder under `job.dump_folder`."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.engine import option as _opt


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
