"""The sections of how a step runs across ranks and devices: the mesh degrees and what FSDP2,
tensor, context, expert and pipeline parallelism do (`Parallelism`), activation checkpointing,
torch.compile and the process groups' timeouts; `sections.JobConfig` holds them. The degrees
are checked against the world size by `parallel/mesh.py`, the rest by `load.validate`."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.engine import option as _opt


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
        "free gathered parameters after forward: default (all but the root), always, never (more memory, less "
        "communication), or a number k: keep them sharded over groups of k ranks (e.g. a node), k dividing the FSDP "
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
        "ways an MoE model's routed experts are split, over ranks borrowed from data_parallel_shard_degree x "
        "context_parallel_degree (tokens exchanged by all-to-all); it must divide both and the experts per layer",
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
        "pipeline schedule (torch's pipelining): one stage per rank (1F1B, GPipe), several (Interleaved1F1B, "
        "LoopedBFS, InterleavedZeroBubble), or two in a V (ZBVZeroBubble, DualPipeV)",
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
        "transformer blocks per stage (the embedding and the output count as the *_less_layers below); none = 1 stage "
        "per rank, or 2 for multi-stage schedules",
        gt=0,
        special=None,
    )
    pipeline_parallel_split_points: list[str] = _opt(
        [],
        "explicit stage boundaries, each the first block of a stage after the first: e.g. layers.3,layers.6 (3 "
        "stages); empty = balanced automatically",
    )
    pipeline_parallel_balance: str = _opt(
        "layers",
        "automatic split: 'layers' counts blocks, the embedding and the output as the *_less_layers below "
        "(torchtitan's rule); 'flops' weighs every block, the embedding and the output head by its training FLOPs per "
        "token and picks the split whose slowest stage is the cheapest",
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
class ActivationCheckpoint:
    """Recompute activations in backward to save memory."""

    mode: str = _opt(
        "none", "which transformer blocks recompute their activations", choices=("none", "full", "selective")
    )
    selective_ac_option: str = _opt(
        "2",
        "with mode selective: a whole number k, recompute every k-th block; or op, recompute each block's cheap ops "
        "and keep its matmul outputs (every other one) and attention (torchtitan's per-op policy)",
    )


@dataclass
class Compile:
    """torch.compile."""

    enable: bool = _opt(False, "compile each transformer block with torch.compile")


@dataclass
class Comm:
    """Process-group timeouts."""

    init_timeout_seconds: int = _opt(
        300, "timeout of collectives through start-up and the first step (every process group of the run)", gt=0
    )
    train_timeout_seconds: int = _opt(
        100, "timeout of collectives after the first step (every process group of the run)", gt=0
    )
