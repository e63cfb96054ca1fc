"""The trainer: `Trainer` runs a short loop of named steps over the parts `startup.build_run`
builds (dist -> mesh -> data -> model -> optimizer -> checkpoint -> metrics -> step
participants). What joins a step optionally (fault tolerance, expert balance, float8 scales,
validation, checkpoints, the scheduled collector, a user's own) is a step participant
(step/participants.py), called at named points; the loop names none of them. The command line
is `titanlite/train.py`, which checks the config before this module (and torch) is imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from titanlite.build import RunPlan, plan_run
from titanlite.config import JobConfig
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
from titanlite.observe.profiling import maybe_profile
from titanlite.parallel.distributed import (
    CollectiveFailure,
    collective_failure,
    set_collective_timeout,
    shutdown,
    world_from_env,
)
from titanlite.parallel.grad_norm import clip_gradients_
from titanlite.runtime.preemption import die_with_launcher, received
from titanlite.runtime.stuck import watch_main_thread
from titanlite.startup import build_run, create_seed_checkpoint
from titanlite.step.agreement import StepAgreement, agree_on_step
from titanlite.step.nonfinite import NonFiniteSteps
from titanlite.step.optim import current_factor
from titanlite.step.participants import StepParticipant

Microbatches = list[tuple[torch.Tensor, torch.Tensor]]


class Trainer:
    """The training loop over a run's parts (`startup.RunParts`, read as the trainer's own
    attributes: `trainer.model`, `.params`, `.optimizer`, `.data`, `.state`, `.plan`, ...).
    `participants` join every step after the run's own (step/participants.py)."""

    def __init__(self, plan: RunPlan, participants: Sequence[StepParticipant] = ()):
        self.run = build_run(plan, participants)
        self.nonfinite = NonFiniteSteps(self.run.cfg.training.max_nan_skips, self.run.dist.rank)
        self.step_lr = 0.0  # the lr of the step just taken (the schedule has moved on when it is logged)

    def __getattr__(self, name: str) -> Any:
        if name == "run":  # not built (yet): no part to look in
            raise AttributeError(name)
        return getattr(self.run, name)

    def train_step(self, microbatches: Microbatches) -> tuple[torch.Tensor, torch.Tensor, StepAgreement]:
        """Gradients of the microbatches (`_gradients`), then the optimizer step unless it is
        skipped. Returns (this rank's loss, grad norm, agreement). A step a participant does not
        commit (fault tolerance: a peer group failed during it) is redone on the same batches."""
        run = self.run
        loss, grad_norm, agreement = self._gradients(microbatches)
        while not run.participants.commit(run.state.step):
            run.participants.before_step(run.state.step, redo=True)
            loss, grad_norm, agreement = self._gradients(microbatches)
        updated = self.nonfinite.allows_update(run.state.step, agreement, grad_norm)
        if updated:
            run.optimizer.step()
        else:
            run.metrics.log_skipped_steps(run.state.step, self.nonfinite.skipped)
        run.participants.after_optimizer_step(updated)
        # what this step trained with (optimizer.lr; groups scale it), before the schedule moves on
        self.step_lr = run.cfg.optimizer.lr * current_factor(run.lr_scheduler)
        run.lr_scheduler.step()
        return loss, grad_norm, agreement

    def _gradients(self, microbatches: Microbatches) -> tuple[torch.Tensor, torch.Tensor, StepAgreement]:
        """Forward/backward over the microbatches, the participants' turn (fault tolerance: the
        replica groups' average), clip, and agree with every rank on the step
        (`step/agreement.agree_on_step`)."""
        run = self.run
        run.optimizer.zero_grad(set_to_none=True)
        loss = run.forward_backward.train(microbatches, run.state.step)
        loss = run.participants.after_backward(run.params, loss)
        grad_norm = clip_gradients_(run.params, run.cfg.training.max_norm, world=run.dist.world_size > 1)
        return loss, grad_norm, agree_on_step(received.stop_signal, loss, grad_norm)

    def log(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> dict[str, float]:
        run = self.run
        fields = run.participants.log_fields()  # collectives, in the order every rank takes them
        reported = run.steps.reported(loss)
        return run.metrics.log(step, reported, grad_norm.item(), self.step_lr, run.state.tokens_seen, fields)

    def train(self) -> list[dict[str, float]]:
        """Run to `training.steps` (resuming from a checkpoint if there is one); returns the
        logged scalars of each log step, for tests and benchmarks."""
        run, cfg = self.run, self.run.cfg
        run.checkpoint.load(run.state)
        run.participants.resume(run.state.step)
        steps = tokens = 0  # what this start trains: a heal moves the train state's step and tokens on
        started = time.perf_counter()
        batches = iter(run.data)  # after load(): the loader resumes from its restored position
        history = []
        with maybe_profile(cfg, run.dist.rank, run.device, run.state.step) as profiler:
            while run.state.step < cfg.training.steps:
                run.participants.before_step(run.state.step + 1)  # fault tolerance may heal: step, data position
                step = run.state.step = run.state.step + 1
                microbatches = [next(batches) for _ in range(run.plan.grad_accum_steps)]
                loss, grad_norm, agreement = self.train_step(microbatches)
                if not steps:  # start-up is over: compile, first all-gathers, load
                    set_collective_timeout(cfg.comm.train_timeout_seconds)
                steps, tokens = steps + 1, tokens + self._count_tokens(len(microbatches))
                last = step == cfg.training.steps
                if step == 1 or step % cfg.metrics.log_freq == 0 or last:
                    history.append({"step": step, **self.log(step, loss, grad_norm)})
                run.participants.after_step(step, last)
                profiler.step()
                if agreement.stop:
                    self._stop_on_signal(step, agreement.stop_signal_name())
                    break
        final_loss = history[-1]["loss"] if history else None
        run.metrics.log_summary(steps, tokens, time.perf_counter() - started, final_loss, run.checkpoint.last_saved())
        return history

    def _count_tokens(self, microbatches: int) -> int:
        """This step's tokens: every dp rank's in the train state (returned), this rank's for throughput."""
        run = self.run
        tokens = run.cfg.training.local_batch_size * run.cfg.training.seq_len * microbatches
        run.state.tokens_seen += tokens * run.data.dp_degree
        run.metrics.add_tokens(tokens)
        return tokens * run.data.dp_degree

    def _stop_on_signal(self, step: int, signal_name: str) -> None:
        """Every rank agreed to stop (SIGTERM or SIGUSR1 reached at least one): a blocking
        checkpoint of the step just finished, and one line on rank 0 saying where."""
        outcome = self.run.checkpoint.save_now(step)
        if self.run.dist.rank == 0:
            say(f"titanlite: stopped by {signal_name} after step {step}; {outcome}")

    def close(self) -> None:
        run = self.run
        run.data.close()
        run.participants.close()
        run.metrics.close()
        if run.run_lock is not None:
            run.run_lock.release()
        received.restore()


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
        line = (
            f"titanlite: error: rank {world_from_env()[0]}: {str(error).split('. ')[0]}; lower "
            f"training.local_batch_size or seq_len, or enable activation_checkpoint"
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
