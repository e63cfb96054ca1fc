"""The trainer: `python -m titanlite.train --config debug_model.toml [--section.key value ...]`.

Read top to bottom: `main` validates everything it can before touching a device, then
`Trainer` builds the pieces in DESIGN.md's order (dist -> mesh -> data -> model ->
parallelize -> optimizer -> checkpoint) and `train` runs a short loop of named steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from titanlite.build import Plan, build_model, plan_run
from titanlite.checkpoint.train_state import TrainState
from titanlite.config import load_config, to_dict
from titanlite.data import build_dataloader
from titanlite.dtypes import DTYPES
from titanlite.errors import USER_ERROR_EXIT_CODE, TitanliteError
from titanlite.logging import init_logger, logger
from titanlite.loss import cross_entropy
from titanlite.metrics import MetricsLogger, peak_flops
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel.distributed import init_distributed, set_collective_timeout, shutdown, world_from_env
from titanlite.parallel.fsdp import set_gradient_sync
from titanlite.parallel.grad_norm import clip_gradients_
from titanlite.precision import resolve_compute_dtype
from titanlite.profiling import maybe_profile


RANK0_REPORT_GRACE_S = 3.0


class Trainer:
    def __init__(self, plan: Plan):
        self.dist = init_distributed(plan.cfg.comm.init_timeout_seconds)
        self.device = self.dist.device
        init_logger(self.dist.rank, log_all_ranks=not plan.cfg.metrics.rank_0_only)
        plan = self.plan = self._resolve_compute_dtype(plan)
        cfg = self.cfg = plan.cfg
        if cfg.job.print_config:
            logger.info(f"config: {to_dict(cfg)}")
        self._seed(cfg.training.seed, cfg.training.deterministic)

        self.meshes = plan.dims.build_mesh(self.device.type)
        dp_mesh = self.meshes.dp
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        self.data = build_dataloader(cfg.training, plan.tokenizer, dp_rank, plan.dims.dp)

        self.model, self.size = build_model(plan, self.device, self.meshes, self.dist.local_world_size)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.state = TrainState()
        self.checkpoint = self._build_checkpoint()

        peak = peak_flops(self.device, DTYPES[cfg.training.mixed_precision_param], cfg.metrics.peak_flops)
        self.metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, self.dist.rank, self.device, self.size.flops_per_token, peak, plan.dims.tp)
        logger.info(
            f"model {cfg.model.name} {cfg.model.flavor}: {self.size.n_params:,} parameters, "
            f"{self.size.flops_per_token / 1e6:,.1f} MFLOPs/token; mesh {self.meshes.world}; "
            f"grad accumulation {plan.grad_accum_steps}; peak {peak.flops or 0:.3g} FLOP/s ({peak.source})"
        )

    def _resolve_compute_dtype(self, plan: Plan) -> Plan:
        """The plan with `mixed_precision_param` made concrete ("auto" decided for this
        device and agreed by every rank), said once at start-up."""
        training = plan.cfg.training
        choice = resolve_compute_dtype(training.mixed_precision_param, self.device)
        logger.info(f"compute dtype {choice.name} ({choice.reason}); master weights and optimizer state float32, "
                    f"gradient reductions {training.mixed_precision_reduce}")
        training = dataclasses.replace(training, mixed_precision_param=choice.name)
        return dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, training=training))

    @staticmethod
    def _seed(seed: int, deterministic: bool) -> None:
        torch.manual_seed(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False

    def _build_checkpoint(self):
        if not (self.cfg.checkpoint.enable_checkpoint or self.cfg.checkpoint.create_seed_checkpoint or self.cfg.checkpoint.initial_load_path):
            return None
        from titanlite.checkpoint.manager import CheckpointManager

        return CheckpointManager(
            self.cfg.checkpoint,
            dump_folder=self.cfg.job.dump_folder,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.data,
            train_state=self.state,
            model_fingerprint={"name": self.cfg.model.name, "flavor": self.cfg.model.flavor, "args": repr(self.plan.model_args)},
            spec=self.plan.spec,
            model_args=self.plan.model_args,
        )

    def _compute_context(self) -> contextlib.AbstractContextManager:
        """Autocast when FSDP (which owns mixed precision otherwise) is not applied. (Loss
        parallel needs no context: `cross_entropy` takes the vocab-sharded logits itself.)"""
        param_dtype = DTYPES[self.cfg.training.mixed_precision_param]
        if not self.plan.dims.fsdp_enabled and param_dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=param_dtype)
        return contextlib.nullcontext()

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over the microbatches, clip, step. Returns (local loss, grad norm)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for index, (inputs, labels) in enumerate(microbatches):
            set_gradient_sync(self.model, index == len(microbatches) - 1)
            inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            with self._compute_context():
                loss = cross_entropy(self.model(inputs), labels) / len(microbatches)
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = clip_gradients_(self.params, self.cfg.training.max_norm, world=self.dist.world_size > 1)
        self.optimizer.step()
        self.lr_scheduler.step()
        return loss_sum, grad_norm

    def _global_mean(self, value: torch.Tensor) -> float:
        """Average over data-parallel ranks (gloo has no AVG, so SUM / size)."""
        if self.dp_group is not None:
            value = value.clone()
            dist.all_reduce(value, group=self.dp_group)
            value /= dist.get_world_size(self.dp_group)
        return value.item()

    def log(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> dict[str, float]:
        return self.metrics.log(step, self._global_mean(loss), grad_norm.item(), self.lr_scheduler.get_last_lr()[0])

    def train(self) -> list[dict[str, float]]:
        """Run to `training.steps` (resuming from a checkpoint if there is one); returns the
        logged scalars of each log step, for tests and benchmarks."""
        cfg = self.cfg
        if self.checkpoint is not None:
            if cfg.checkpoint.create_seed_checkpoint:
                self.checkpoint.save_seed()
                return []
            self.checkpoint.load()
            if self.state.step:
                logger.info(f"resumed at step {self.state.step}")
        set_collective_timeout(cfg.comm.train_timeout_seconds)
        batches = iter(self.data)  # after load(): the loader resumes from its restored position
        history = []
        tokens_per_microbatch = cfg.training.local_batch_size * cfg.training.seq_len
        with maybe_profile(cfg, self.dist.rank) as profiler:
            while self.state.step < cfg.training.steps:
                self.state.step += 1
                step = self.state.step
                microbatches = [next(batches) for _ in range(self.plan.grad_accum_steps)]
                loss, grad_norm = self.train_step(microbatches)
                self.state.tokens_seen += tokens_per_microbatch * len(microbatches) * self.plan.dims.dp
                self.metrics.add_tokens(tokens_per_microbatch * len(microbatches))
                last = step == cfg.training.steps
                if step == 1 or step % cfg.metrics.log_freq == 0 or last:
                    history.append({"step": step, **self.log(step, loss, grad_norm)})
                if self.checkpoint is not None:
                    self.checkpoint.save(step, last=last)
                profiler.step()
        return history

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()
        self.metrics.close()


def report_user_error(error: TitanliteError) -> int:
    """One line on rank 0, nothing from the others; the exit code says it was the input.

    Every rank meets the same error (validation is deterministic; checkpoint problems are
    decided on rank 0 and broadcast). The other ranks wait a moment before exiting: torchrun
    stops all processes as soon as one fails, which could kill rank 0 before its line is out.
    """
    rank, _ = world_from_env()
    if rank == 0:
        print(f"titanlite: error: {error}", file=sys.stderr, flush=True)
    else:
        time.sleep(RANK0_REPORT_GRACE_S)
    return USER_ERROR_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        plan = plan_run(cfg, world_from_env()[1])
    except TitanliteError as error:
        return report_user_error(error)
    trainer = None
    try:
        trainer = Trainer(plan)
        trainer.train()
        return 0
    except TitanliteError as error:
        return report_user_error(error)
    except torch.OutOfMemoryError as error:
        # A config this hardware cannot hold, like a bad input: one line (the allocator's
        # first sentence) and the user-error exit code, which the launcher passes on quietly.
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"titanlite: error: rank {rank}: {str(error).split('. ')[0]}; lower training.local_batch_size "
              f"or seq_len, or enable activation_checkpoint", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    finally:
        if trainer is not None:
            trainer.close()
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
