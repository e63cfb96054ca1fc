"""Start-up: a run plan to the parts a run trains with, in order (dist -> mesh -> data ->
model -> optimizer -> checkpoint -> metrics -> step participants), in one function,
`build_run`, which returns them as a `RunParts`; `trainer.Trainer` runs the loop over them.
`create_seed_checkpoint` is the other start-up: the model initialized and saved as step 0.

A user's own step participants (step/participants.py) join through `build_run`'s
`participants` (or `Trainer(plan, participants=[...])`), after the run's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.build import ModelSize, RunPlan, build_model
from titanlite.checkpoint import commit
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.checkpoint.train_state import TrainState
from titanlite.config import JobConfig, to_dict
from titanlite.config.dtypes import DTYPES
from titanlite.data import build_dataloader, open_corpus
from titanlite.data.loader import TokenWindowLoader
from titanlite.errors import TitanliteError
from titanlite.logging import init_logger, logger
from titanlite.observe.metrics import MetricsLogger
from titanlite.observe.peak_flops import peak_flops
from titanlite.observe.run_dir import start_run_dir
from titanlite.observe.wandb_run import require_wandb
from titanlite.parallel.distributed import DistInfo, init_distributed
from titanlite.runtime.dump_folder import RunLock, claim_dump_folder
from titanlite.runtime.fault_tolerance import LoneGroup, ReplicaGroup, data_share, prepare_replica_group
from titanlite.runtime.gc_schedule import ScheduledGC
from titanlite.runtime.preemption import received
from titanlite.step.builder import StepBuilder
from titanlite.step.experts import ExpertLayers
from titanlite.step.forward_backward import Pipelined, Unpipelined
from titanlite.step.optim import build_lr_scheduler, build_optimizer, trained_parameters
from titanlite.step.mtp import MultiTokenPrediction
from titanlite.step.participants import Float8Scales, Participants, StepParticipant
from titanlite.step.precision import resolve_compute_dtype
from titanlite.step.validate import Validator


class NoCheckpoints(StepParticipant):
    """The run neither saves nor loads checkpoints (checkpoint.enable_checkpoint false, no
    initial_load_path): nothing to load, save or close; a stop signal saves nothing."""

    def load(self, state: TrainState) -> None:
        pass

    def save_now(self, step: int) -> str:
        return "nothing saved (checkpoint.enable_checkpoint is false)"

    def last_saved(self) -> Path | None:
        return None


class Checkpointing(NoCheckpoints):
    """The run's checkpoints as a step participant: `load` before the first step, a save after
    each (`checkpoint/manager.py` decides whether it is due; under fault tolerance only the
    group that `saves` does), and a blocking save on a stop signal."""

    def __init__(self, manager: CheckpointManager, saves: Callable[[], bool]) -> None:
        self.manager, self.saves = manager, saves

    def load(self, state: TrainState) -> None:
        self.manager.load()
        if state.step:
            logger.info(f"resumed at step {state.step}")

    def after_step(self, step: int, last: bool) -> None:
        if self.saves():
            self.manager.save(step, last=last)

    def save_now(self, step: int) -> str:
        """A blocking save of `step` (a stop signal's), and what became of it for the last line
        (a run that only loads, from initial_load_path, saves nothing)."""
        if not self.manager.cfg.enable_checkpoint:
            return super().save_now(step)
        return f"checkpoint saved to {self.manager.save_now(step)}"

    def last_saved(self) -> Path | None:
        """The newest step folder this start saved (in flight or committed), for the summary."""
        saved = self.manager.pipeline.saved_steps
        return commit.step_dir(self.manager.root, max(saved)) if saved else None

    def close(self) -> None:
        self.manager.close()


class RunParts:
    """Everything a run trains with, filled in by `build_run` in the order of start-up (a
    `Trainer` reads them as its own attributes: `trainer.model`, `.optimizer`, `.data`, ...)."""

    plan: RunPlan  # the dtype decided, the dump folder this job's
    dist: DistInfo
    run_lock: RunLock | None  # rank 0's
    run_dir: Path
    steps: StepBuilder
    data: TokenWindowLoader
    model_parts: list[nn.Module]  # what runs forward: the model, or this rank's pipeline stages
    model: nn.Module  # what the optimizer, clipping and checkpoints read
    size: ModelSize
    mtp: MultiTokenPrediction | None  # the model's multi-token prediction objective, a participant
    forward_backward: Unpipelined | Pipelined
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    state: TrainState
    metrics: MetricsLogger
    checkpoint: NoCheckpoints  # a Checkpointing when the run saves or loads any
    validator: Validator | None
    participants: Participants  # every one, in order: the checkpoint and the validator too

    @property
    def cfg(self) -> JobConfig:
        return self.plan.cfg

    @property
    def device(self) -> torch.device:
        return self.dist.device


def build_run(plan: RunPlan, participants: Sequence[StepParticipant] = ()) -> RunParts:
    """Every part of a run, from its plan; `participants` join every step after the run's own.

    After the process and the training's parts: fault tolerance, the checkpoints, metrics and
    validation; then every participant in the order each point calls them: the expert load
    before the quorum on the step line, a heal before the float8 scales, and after a step
    validation, then the save, then the collector."""
    run = RunParts()
    _start_process(run, plan)
    validation_data, experts = _build_training(run)
    cfg, states = run.cfg, {"lr_scheduler": run.lr_scheduler, "dataloader": run.data, "train_state": run.state}
    ft = cfg.fault_tolerance
    group = ReplicaGroup(ft, run.model, run.optimizer, states, run.dist, experts) if ft.enable else LoneGroup()
    run.checkpoint = NoCheckpoints()  # when the run neither saves nor loads checkpoints
    if cfg.checkpoint.enable_checkpoint or cfg.checkpoint.initial_load_path:
        parts = {"optimizer": run.optimizer, "tokenizer": run.plan.tokenizer, **states}
        run.checkpoint = Checkpointing(_checkpoint_manager(run.plan, run.model, **parts), group.saves_checkpoints)
    run.metrics = _metrics(run)
    evaluates = (validation_data, run.model, run.forward_backward, run.steps.reported, run.metrics)
    run.validator = Validator(cfg.validation, *evaluates) if cfg.validation.enable else None
    _say_start(run)
    float8 = Float8Scales(run.model_parts) if run.plan.precomputes_float8_scales else StepParticipant()
    validator = run.validator or StepParticipant()  # a no-op without validation, as float8's
    members = [run.steps.expert_balance(run.model, experts), run.mtp or StepParticipant(), group, float8, validator]
    members.append(run.checkpoint)
    run.participants = Participants([*members, ScheduledGC(cfg.training.gc_freq), *participants])
    return run


def _start_process(run: RunParts, plan: RunPlan) -> None:
    """Before any device is used, the checks of optional packages; then the process group, the
    logger, the compute dtype, the seed, and the folders: this job's dump folder in the plan,
    its lock and its run folder."""
    require_wandb(plan.cfg.metrics)  # a missing optional package: one line before any device is used
    plan = plan.with_dump_folder(prepare_replica_group(plan.cfg))
    received.install()  # a stop request during start-up is kept
    run.dist = init_distributed(plan.cfg.comm.init_timeout_seconds, cpu_offload=plan.cfg.training.enable_cpu_offload)
    init_logger(run.dist.rank, log_all_ranks=not plan.cfg.metrics.rank_0_only)
    run.plan = plan = resolve_plan_dtype(plan, run.device)
    if plan.cfg.job.print_config:
        logger.info(f"config: {to_dict(plan.cfg)}")
    _seed(plan.cfg.training.seed, plan.cfg.training.deterministic)
    run.run_lock = claim_dump_folder(plan.cfg, lambda: plan.n_params, dist.group.WORLD)
    run.run_dir = start_run_dir(plan.cfg)


def _build_training(run: RunParts) -> tuple[TokenWindowLoader | None, ExpertLayers | None]:
    """The step's plumbing, the loaders, the model, the optimizer and its schedule; returns the
    validation loader and the model's MoE layers for the participants."""
    plan, cfg = run.plan, run.cfg
    meshes = plan.dims.build_mesh(run.device.type)
    run.steps = StepBuilder.for_run(
        cfg, dims=plan.dims, pipeline=plan.pipeline, meshes=meshes, device=run.device, rank=run.dist.rank
    )
    run.data, validation_data = _loaders(plan, run.steps)
    built = build_model(plan, run.device, meshes, run.dist.local_world_size)
    run.model_parts, run.model, run.size = built.parts, built.model, built.size
    run.mtp = run.steps.multi_token(plan.model_args.mtp_depths, cfg.training.mtp_loss_weight)
    run.forward_backward = run.steps.forward_backward(
        run.model, run.model_parts, built.experts, run.data.stream.masked, run.mtp
    )
    named_params = trained_parameters(run.model)
    run.params = [p for _, p in named_params]
    run.optimizer = build_optimizer(named_params, cfg.optimizer, no_decay=plan.spec.no_decay)
    run.lr_scheduler = build_lr_scheduler(run.optimizer, cfg.lr_scheduler, cfg.training.steps)
    run.state = TrainState()
    return validation_data, built.experts


def _seed(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _loaders(plan: RunPlan, steps: StepBuilder) -> tuple[TokenWindowLoader, TokenWindowLoader | None]:
    """This rank's training loader and validation loader (None without validation windows), over
    this replica group's share of every global batch."""
    cfg = plan.cfg
    dp_rank, dp_degree = data_share(cfg.fault_tolerance, steps.meshes.dp_rank, plan.dims.dp)
    corpus = open_corpus(cfg.training, cfg.validation, plan.tokenizer, cfg.sft)
    if corpus.train.masked and not steps.documents:
        raise TitanliteError(
            "model.attn_mask_type: chat data packs several conversations in a window; set block_causal so that "
            "none attends to another"
        )
    per_rank = (cfg.training.local_batch_size, dp_rank, dp_degree, steps.device)  # the same for both loaders
    data = build_dataloader(corpus.train, *per_rank, documents=steps.documents)
    if corpus.validation is None:
        return data, None
    return data, build_dataloader(corpus.validation, *per_rank, prefetch=False, documents=steps.documents)


def _checkpoint_manager(plan: RunPlan, model: nn.Module, **parts: Any) -> CheckpointManager:
    """The run's checkpoints over its model and the rest they keep (`parts`: a training run's
    optimizer, schedule, loader, train state and tokenizer)."""
    cfg = plan.cfg
    return CheckpointManager(
        cfg.checkpoint,
        cfg.job.dump_folder,
        plan.spec,
        cfg.model.flavor,
        plan.model_args,
        model=model,
        lora=plan.lora,
        **parts,
    )


def _metrics(run: RunParts) -> MetricsLogger:
    """The step line's logger, its MFU over this device's peak."""
    cfg = run.cfg
    return MetricsLogger(
        cfg.metrics,
        cfg.job.dump_folder,
        run.dist.rank,
        run.device,
        run.size.flops_per_token,
        peak_flops(run.device, DTYPES[cfg.training.mixed_precision_param], cfg.metrics.peak_flops, run.dist.local_rank),
        run.plan.dims.non_data_parallel_size,
        run.run_dir,
        run_config=to_dict(cfg),
    )


def _say_start(run: RunParts) -> None:
    """The start-up lines: the model, mesh, accumulation and peak; the pipeline's stages."""
    plan, cfg, size, peak, dims = run.plan, run.cfg, run.size, run.metrics.peak, run.plan.dims
    experts = f" (experts: ep {dims.ep} x efsdp {dims.efsdp})" if dims.ep > 1 else ""
    logger.info(
        f"model {cfg.model.name} {plan.model_label}: {size.n_params:,} parameters, "
        f"{size.flops_per_token / 1e6:,.1f} MFLOPs/token; mesh {run.steps.meshes.world}{experts}; "
        f"grad accumulation {plan.grad_accum_steps}; peak {peak.flops or 0:.3g} FLOP/s ({peak.source})"
    )
    if plan.pipeline is not None:
        logger.info(plan.pipeline.describe())


def resolve_plan_dtype(plan: RunPlan, device: torch.device) -> RunPlan:
    """The plan with `mixed_precision_param` made concrete ("auto" decided for this device
    and agreed by every rank), said once at start-up: the model is built only from a
    concrete dtype, for training and for a seed checkpoint alike."""
    training = plan.cfg.training
    choice = resolve_compute_dtype(training.mixed_precision_param, device)
    logger.info(
        f"compute dtype {choice.name} ({choice.reason}); master weights and optimizer state float32, "
        f"gradient reductions {training.mixed_precision_reduce}"
    )
    return plan.with_compute_dtype(choice.name)


def create_seed_checkpoint(plan: RunPlan) -> None:
    """`checkpoint.create_seed_checkpoint`: initialize the model on this one process and save
    it as step 0, model only. A later run of any layout in the same folder starts from it
    (DCP reshards), so a large model is initialized once instead of on every start."""
    cfg = plan.cfg
    info = init_distributed(cfg.comm.init_timeout_seconds)
    init_logger(info.rank)
    plan = resolve_plan_dtype(plan, info.device)  # the weights are saved in float32 whatever it is
    torch.manual_seed(cfg.training.seed)
    lock = claim_dump_folder(cfg, lambda: plan.n_params, dist.group.WORLD, weights_only=True)
    model = build_model(plan, info.device, plan.dims.build_mesh(info.device.type), info.local_world_size).model
    manager = _checkpoint_manager(plan, model)
    try:
        manager.save_seed()
    finally:
        manager.close()
        lock.release()
