"""The trainer: `Trainer` builds the pieces in order (dist -> mesh -> data ->
model -> parallelize -> optimizer -> checkpoint) and `train` runs a short loop of named
steps. The command line is `titanlite/train.py`, which checks the config before this module
(and torch) is imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from titanlite.build import RunPlan, build_model, plan_run
from titanlite.checkpoint import commit
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.checkpoint.train_state import TrainState
from titanlite.config import JobConfig, to_dict
from titanlite.config.dtypes import DTYPES
from titanlite.data import build_dataloader, open_corpus
from titanlite.errors import (
    COLLECTIVE_FAILURE_EXIT_CODE,
    INTERRUPTED_EXIT_CODE,
    RANK0_REPORT_GRACE_S,
    USER_ERROR_EXIT_CODE,
    TitanliteError,
    hand_to_launcher,
    report_user_error,
    say,
)
from titanlite.logging import init_logger, logger
from titanlite.observe.metrics import MetricsLogger
from titanlite.observe.peak_flops import peak_flops
from titanlite.observe.profiling import maybe_profile
from titanlite.observe.run_dir import start_run_dir
from titanlite.observe.wandb_run import require_wandb
from titanlite.parallel.distributed import (
    CollectiveFailure,
    collective_failure,
    init_distributed,
    set_collective_timeout,
    shutdown,
    world_from_env,
)
from titanlite.parallel.float8 import precompute_scales
from titanlite.parallel.grad_norm import clip_gradients_
from titanlite.runtime.dump_folder import claim_dump_folder
from titanlite.runtime.fault_tolerance import build_replica_group, data_share, prepare_replica_group
from titanlite.runtime.gc_schedule import ScheduledGC
from titanlite.runtime.preemption import die_with_launcher, received
from titanlite.runtime.stuck import watch_main_thread
from titanlite.step.agreement import StepAgreement, agree_on_step
from titanlite.step.builder import StepBuilder
from titanlite.step.nonfinite import NonFiniteSteps
from titanlite.step.optim import build_lr_scheduler, build_optimizer, current_factor, trained_parameters
from titanlite.step.precision import resolve_compute_dtype
from titanlite.step.validate import build_validator


class Trainer:
    def __init__(self, plan: RunPlan):
        require_wandb(plan.cfg.metrics)  # a missing optional package: one line before any device is used
        prepare_replica_group(plan.cfg)
        self.signals = received.install()  # a stop request during start-up is kept
        self.dist = init_distributed(
            plan.cfg.comm.init_timeout_seconds, cpu_offload=plan.cfg.training.enable_cpu_offload
        )
        self.nonfinite = NonFiniteSteps(plan.cfg.training.max_nan_skips, self.dist.rank)
        self.device = self.dist.device
        init_logger(self.dist.rank, log_all_ranks=not plan.cfg.metrics.rank_0_only)
        plan = self.plan = resolve_plan_dtype(plan, self.device)
        cfg = self.cfg = plan.cfg
        if cfg.job.print_config:
            logger.info(f"config: {to_dict(cfg)}")
        self._seed(cfg.training.seed, cfg.training.deterministic)
        self.run_lock = claim_dump_folder(cfg, lambda: plan.n_params, dist.group.WORLD)
        self.run_dir = start_run_dir(cfg)

        self.meshes = plan.dims.build_mesh(self.device.type)
        self.steps = StepBuilder.for_run(
            cfg, dims=plan.dims, pipeline=plan.pipeline, meshes=self.meshes, device=self.device, rank=self.dist.rank
        )
        dp_rank = self.meshes.dp.get_local_rank() if self.meshes.dp is not None else 0
        dp_rank, dp_degree = data_share(cfg.fault_tolerance, dp_rank, plan.dims.dp)  # this replica group's share
        corpus = open_corpus(cfg.training, cfg.validation, plan.tokenizer)
        documents = self.steps.documents
        self.data = build_dataloader(
            corpus.train, cfg.training.local_batch_size, dp_rank, dp_degree, self.device, documents=documents
        )
        validation_data = (
            None
            if corpus.validation is None
            else build_dataloader(
                corpus.validation,
                cfg.training.local_batch_size,
                dp_rank,
                dp_degree,
                self.device,
                prefetch=False,
                documents=documents,
            )
        )

        built = build_model(plan, self.device, self.meshes, self.dist.local_world_size)
        self.model_parts, self.model, self.size = built.parts, built.model, built.size
        self.forward_backward = self.steps.forward_backward(self.model, self.model_parts, built.experts)
        self.expert_balance = self.steps.expert_balance(self.model, built.experts)  # None without MoE layers
        named_params = trained_parameters(self.model)
        self.params = [p for _, p in named_params]
        self.optimizer = build_optimizer(named_params, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.step_lr = 0.0  # the lr of the step just taken (the schedule has moved on when it is logged)
        self.state = TrainState()
        self.checkpoint = self._build_checkpoint()
        states = {"lr_scheduler": self.lr_scheduler, "dataloader": self.data, "train_state": self.state}
        self.ft = build_replica_group(cfg.fault_tolerance, self.model, self.optimizer, states, self.dist)

        peak = peak_flops(self.device, DTYPES[cfg.training.mixed_precision_param], cfg.metrics.peak_flops)
        self.metrics = MetricsLogger(
            cfg.metrics,
            cfg.job.dump_folder,
            self.dist.rank,
            self.device,
            self.size.flops_per_token,
            peak,
            plan.dims.tp * plan.dims.cp * plan.dims.pp,
            self.run_dir,
            run_config=to_dict(cfg),
        )
        self.validator = build_validator(
            cfg.validation,
            validation_data,
            self.model,
            self.forward_backward.evaluate,
            self.steps.reported,
            self.device,
            self.metrics,
        )
        dims = plan.dims
        experts = f" (experts: ep {dims.ep} x efsdp {dims.dp_shard * dims.cp // dims.ep})" if dims.ep > 1 else ""
        logger.info(
            f"model {cfg.model.name} {cfg.model.flavor}: {self.size.n_params:,} parameters, "
            f"{self.size.flops_per_token / 1e6:,.1f} MFLOPs/token; mesh {self.meshes.world}{experts}; "
            f"grad accumulation {plan.grad_accum_steps}; peak {peak.flops or 0:.3g} FLOP/s ({peak.source})"
        )
        if plan.pipeline is not None:
            logger.info(plan.pipeline.describe())

    @staticmethod
    def _seed(seed: int, deterministic: bool) -> None:
        torch.manual_seed(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False

    def _build_checkpoint(self):
        if not (self.cfg.checkpoint.enable_checkpoint or self.cfg.checkpoint.initial_load_path):
            return None
        return CheckpointManager(
            self.cfg.checkpoint,
            self.cfg.job.dump_folder,
            self.plan.spec,
            self.cfg.model.flavor,
            self.plan.model_args,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.data,
            train_state=self.state,
            tokenizer=self.plan.tokenizer,
        )

    def train_step(
        self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, StepAgreement]:
        """Gradients of the microbatches (`_gradients`), then the optimizer step unless it is
        skipped. Returns (this rank's loss, grad norm, agreement). Under fault tolerance a step
        that a peer group failed during is not committed by any group: it is redone on the same
        batches by the new quorum (runtime/fault_tolerance.py)."""
        loss, grad_norm, agreement = self._gradients(microbatches)
        while self.ft is not None and not self.ft.commit():
            self.ft.begin_step(self.state.step - 1, redo=True)
            loss, grad_norm, agreement = self._gradients(microbatches)
        updated = self.nonfinite.allows_update(self.state.step, agreement, grad_norm)
        if updated:
            self.optimizer.step()
        else:
            self.metrics.log_skipped_steps(self.state.step, self.nonfinite.skipped)
        if self.expert_balance is not None:
            self.expert_balance.after_step(updated)
        # what this step trained with (optimizer.lr; groups scale it), before the schedule moves on
        self.step_lr = self.cfg.optimizer.lr * current_factor(self.lr_scheduler)
        self.lr_scheduler.step()
        return loss, grad_norm, agreement

    def _gradients(
        self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, StepAgreement]:
        """Forward/backward over the microbatches, (with fault tolerance) the replica groups'
        average, clip, and agree with every rank on the step (`step/agreement.agree_on_step`)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.plan.precomputes_float8_scales:
            precompute_scales(self.model_parts)  # this step's float8 all-gather scales: one all-reduce
        loss = self.forward_backward.train(microbatches, self.state.step)
        if self.ft is not None:
            loss = self.ft.average_gradients(self.params, loss)
        grad_norm = clip_gradients_(self.params, self.cfg.training.max_norm, world=self.dist.world_size > 1)
        return loss, grad_norm, agree_on_step(self.signals.stop_signal, loss, grad_norm)

    def log(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> dict[str, float]:
        expert_load = self.expert_balance.load() if self.expert_balance is not None else None
        return self.metrics.log(
            step,
            self.steps.reported(loss),
            grad_norm.item(),
            self.step_lr,
            self.state.tokens_seen,
            expert_load=expert_load,
            quorum=self.ft.quorum if self.ft is not None else None,
        )

    def train(self) -> list[dict[str, float]]:
        """Run to `training.steps` (resuming from a checkpoint if there is one); returns the
        logged scalars of each log step, for tests and benchmarks."""
        cfg = self.cfg
        if self.checkpoint is not None:
            self.checkpoint.load()
            if self.state.step:
                logger.info(f"resumed at step {self.state.step}")
            if self.ft is not None:
                self.ft.resume_from(self.state.step)
        first_step, tokens_before, started = self.state.step + 1, self.state.tokens_seen, time.perf_counter()
        batches = iter(self.data)  # after load(): the loader resumes from its restored position
        history = []
        tokens_per_microbatch = cfg.training.local_batch_size * cfg.training.seq_len
        with (
            maybe_profile(cfg, self.dist.rank, self.device, self.state.step) as profiler,
            ScheduledGC(cfg.training.gc_freq) as collector,
        ):
            while self.state.step < cfg.training.steps:
                if self.ft is not None:  # the quorum; a joining group heals here (step, data position included)
                    self.ft.begin_step(self.state.step)
                self.state.step += 1
                step = self.state.step
                microbatches = [next(batches) for _ in range(self.plan.grad_accum_steps)]
                loss, grad_norm, agreement = self.train_step(microbatches)
                if step == first_step:  # start-up is over: compile, first all-gathers, load
                    set_collective_timeout(cfg.comm.train_timeout_seconds)
                self.state.tokens_seen += tokens_per_microbatch * len(microbatches) * self.data.dp_degree
                self.metrics.add_tokens(tokens_per_microbatch * len(microbatches))
                last = step == cfg.training.steps
                if step == 1 or step % cfg.metrics.log_freq == 0 or last:
                    history.append({"step": step, **self.log(step, loss, grad_norm)})
                if self.validator is not None:
                    self.validator.maybe_run(step, last)
                if self.checkpoint is not None and (self.ft is None or self.ft.saves_checkpoints()):
                    self.checkpoint.save(step, last=last)
                profiler.step()
                collector.after_step(step)
                if agreement.stop:
                    self._stop_on_signal(step, agreement.stop_signal_name())
                    break
        self.metrics.log_summary(
            self.state.step - first_step + 1,
            self.state.tokens_seen - tokens_before,
            time.perf_counter() - started,
            history[-1]["loss"] if history else None,
            self._last_checkpoint(),
        )
        return history

    def _last_checkpoint(self) -> Path | None:
        """The newest step folder this start saved (in flight or committed), for the summary."""
        saved = self.checkpoint.pipeline.saved_steps if self.checkpoint is not None else ()
        return commit.step_dir(self.checkpoint.root, max(saved)) if saved else None

    def _stop_on_signal(self, step: int, signal_name: str) -> None:
        """Every rank agreed to stop (SIGTERM or SIGUSR1 reached at least one): a blocking
        checkpoint of the step just finished, and one line on rank 0 saying where."""
        if self.checkpoint is not None and self.cfg.checkpoint.enable_checkpoint:
            outcome = f"checkpoint saved to {self.checkpoint.save_now(step)}"
        else:
            outcome = "nothing saved (checkpoint.enable_checkpoint is false)"
        if self.dist.rank == 0:
            say(f"titanlite: stopped by {signal_name} after step {step}; {outcome}")

    def close(self) -> None:
        if self.ft is not None:
            self.ft.close()
        self.data.close()
        if self.checkpoint is not None:
            self.checkpoint.close()
        self.metrics.close()
        if self.run_lock is not None:
            self.run_lock.release()
        self.signals.restore()


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
    manager = CheckpointManager(
        cfg.checkpoint, cfg.job.dump_folder, plan.spec, cfg.model.flavor, plan.model_args, model=model
    )
    try:
        manager.save_seed()
    finally:
        manager.close()
        lock.release()


def run(plan: RunPlan) -> None:
    """Train, or write the seed checkpoint: the two things this entry point does."""
    if plan.cfg.checkpoint.create_seed_checkpoint:
        create_seed_checkpoint(plan)
        return
    trainer = Trainer(plan)
    try:
        trainer.train()
    except BaseException:
        # The failure is what the user must read; a second one while closing (an in-flight
        # save whose peer is gone) would replace it.
        with contextlib.suppress(Exception):
            trainer.close()
        raise
    trainer.close()


def report_collective_failure(failure: CollectiveFailure) -> int:
    """A rank whose collective timed out says which one. Under `titanlite.launch` the line
    goes to the launcher, which names the first cause once (a rank it found stopped, one
    that died or made a user error) or else prints this line. Otherwise a rank whose peer
    died first waits a moment for the launcher's stop (SIGTERM): when it comes, the launcher
    names the rank that died and this one stays quiet; when it does not (the dead rank ran
    under another node's launcher), this rank says it itself."""
    code = INTERRUPTED_EXIT_CODE if received.interrupted else COLLECTIVE_FAILURE_EXIT_CODE
    if hand_to_launcher(f"titanlite: rank {world_from_env()[0]}: {failure.line}"):
        return code
    deadline = time.monotonic() + RANK0_REPORT_GRACE_S
    while not (failure.timed_out or received.stop_signal or received.interrupted) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not received.interrupted and (failure.timed_out or not received.stop_signal):
        say(f"titanlite: rank {world_from_env()[0]}: {failure.line}")
    return code


def run_checked(cfg: JobConfig) -> int:
    """Plan and run a loaded config; every way it ends is an exit code (see train.main),
    returned, or for a failed collective the process's own (`_exit_at_once`)."""
    die_with_launcher()
    try:
        with watch_main_thread():  # for the launcher to name this rank if it gets stuck
            run(plan_run(cfg, world_from_env()[1]))
        return 0
    except TitanliteError as error:
        return report_user_error(error)
    except torch.OutOfMemoryError as error:
        # A config this hardware cannot hold, like a bad input: one line (the allocator's
        # first sentence) and the user-error exit code, which the launcher passes on quietly.
        rank = dist.get_rank() if dist.is_initialized() else 0
        line = (
            f"titanlite: error: rank {rank}: {str(error).split('. ')[0]}; lower training.local_batch_size "
            f"or seq_len, or enable activation_checkpoint"
        )
        if not hand_to_launcher(line):
            say(line)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        return INTERRUPTED_EXIT_CODE  # Ctrl-C: the launcher prints the one line
    except Exception as error:
        failure = collective_failure(error)
        if failure is None:
            raise
        code = report_collective_failure(failure)
    finally:
        shutdown()
    _exit_at_once(code)  # only a failed collective gets here: every other way returned or raised


def _exit_at_once(code: int) -> NoReturn:
    """End a worker whose collective failed without Python's teardown of torch's state: it
    took 5-6 s of a 4-rank pipeline job's end on a loaded 2-core host, and the launcher
    stops the other ranks (and kills a stuck one) only once the first has exited. The ending
    line is out already (handed to the launcher, or said)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
