"""Fault tolerance without a restart: this job is one replica group of several, on torchft.

Each replica group is its own torchrun job with any layout inside; the groups together are
the data-parallel replicate dimension, and torchft's `Manager` runs it: the quorum (which
groups take part in a step, from its lighthouse), the average of the gradients across the
groups, the commit decision of each step (`should_commit`) and the healing of a group that
joins late (model, optimizer, lr schedule, data position, step and RNG sent from a live group
by torchft's checkpoint transport). Nothing here is a quorum, heartbeat or transfer of our own.

The trainer touches it as a step participant (step/participants.py), always there:
the start-up (startup.py) builds a `ReplicaGroup`, or without fault tolerance a `LoneGroup`
that does nothing. A `ReplicaGroup` joins a step at four points: `before_step`, before a step draws
its batches (the quorum; a joining group is healed there, so it draws from the live group's
data position), `after_backward` (the gradients averaged over the groups, before clipping),
`commit` before the optimizer step, and `log_fields` (the quorum on the step line); `resume`
takes a checkpoint's step. With `semi_sync_method` (DiLoCo, local SGD) the groups train alone
and torchft's own classes synchronize them every `sync_steps` optimizer steps from hooks on
the optimizer; the per-step calls then do nothing.

Each group reads its own share of every global batch (`data_share`): group g's dp ranks are
dp ranks g*dp .. g*dp+dp-1 of a data-parallel degree of group_size * dp, the same windows a
plain HSDP run with data_parallel_replicate_degree = group_size reads. While a group is down,
its share of those steps is not trained.
"""

from __future__ import annotations

import logging
import math
import re
import os
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from titanlite.config.fault_tolerance import FaultTolerance
from titanlite.config.sections import JobConfig
from titanlite.errors import TitanliteError
from titanlite.logging import logger
from titanlite.parallel.distributed import DistInfo
from titanlite.parallel.placement import local_tensor, shard_like
from titanlite.step.experts import ExpertLayers
from titanlite.step.participants import LineField, StepParticipant

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def prepare_replica_group(cfg: JobConfig) -> str:
    """Before any device is used: one line when torchft (the `ft` extra), NCCL for process_group
    nccl, or the lighthouse's address is missing. Returns the folder this job writes under:
    `job.dump_folder`, or each group its own `job.dump_folder/replica_<id>` (its run lock,
    metrics and the checkpoints it saves are its own); the config itself is not edited."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return cfg.job.dump_folder
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    # its warnings are NCCL's on a CPU run, its errors a traceback per rank for a peer's failure
    # that the lines here say once (a shrink, a redone step, a failed quorum)
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # a heal's received tensors
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise TitanliteError(
            "fault_tolerance.enable: needs torchft, which is not installed (pip install 'titanlite[ft]')"
        ) from None
    if ft.process_group == "nccl" and not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        raise TitanliteError(
            "fault_tolerance.process_group: nccl needs CUDA devices and a torch built with NCCL, which this "
            "host lacks; use gloo"
        )
    if not os.environ.get(LIGHTHOUSE_ENV):
        raise TitanliteError(
            f"fault_tolerance.enable: {LIGHTHOUSE_ENV} is not set; start torchft_lighthouse and set it to its "
            "address, e.g. http://localhost:29510 (scripts/run_ft_local.sh does both)"
        )
    return str(Path(cfg.job.dump_folder) / f"replica_{ft.replica_id}")


def data_share(ft: FaultTolerance, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """(dp rank, dp degree) of this rank's share of every global batch: the group's own dp
    ranks within all groups' (without fault tolerance: unchanged)."""
    return (ft.replica_id * dp_degree + dp_rank, ft.group_size * dp_degree) if ft.enable else (dp_rank, dp_degree)


def _like_param(value: Any, param: torch.Tensor) -> Any:
    """A received optimizer-state tensor back on its parameter's mesh (a local shard
    arrives); scalars (the step count) stay plain, each its own copy."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(param, DTensor) and value.dim() > 0:
        return shard_like(value.clone(), param)
    return value.clone()


def _average(manager: Any, tensors: list[torch.Tensor]) -> None:
    """Average `tensors` in place over the quorum, in one all-reduce of one flat float32 buffer;
    left as they were if it failed (a peer died: `manager.errored()` says so)."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    manager.allreduce(flat).wait()
    if manager.errored() is None:
        for t, averaged in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(averaged.view_as(t))


def _first_line(error: BaseException) -> str:
    """The start of an error's message (torchft wraps a peer's failure: the original's; a gRPC
    status from the lighthouse: its message, without the status's metadata)."""
    text = str(getattr(error, "original_exception", error)).splitlines()[0]
    grpc = re.search(r'message: "([^"]*)"', text)
    return (grpc[1] if grpc else text)[:200]


class LoneGroup(StepParticipant):
    """Fault tolerance off: this job is the only group; it joins no step and saves its checkpoints."""

    def saves_checkpoints(self) -> bool:
        return True


class ReplicaGroup(StepParticipant):
    """This group's torchft Manager and what a training step asks of it (a step participant).

    `states`: the Stateful pieces a healing group receives from a live one besides the model
    and the optimizer (lr schedule, data loader, train state with its RNG); they are sent as
    their `state_dict()` with DTensors as their local shards, so the groups must share a layout.
    """

    def __init__(
        self,
        ft: FaultTolerance,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        states: dict[str, Any],
        dist_info: DistInfo,
        experts: ExpertLayers | None = None,
    ) -> None:
        self.ft, self.model, self.optimizer, self.states, self.experts = ft, model, optimizer, states, experts
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.manager = _start_manager(ft, self._load, self._state, dist_info.rank, dist_info.world_size)
        self.per_step = ft.semi_sync_method == "none"  # else the optimizer's hooks sync the groups
        self.participants = 0  # groups in the last quorum
        self.waiting = False  # the last quorum had fewer than min_replica_size groups
        self.healed_at: int | None = None  # the step a heal brought this group to, until it is said
        self.semi_sync: Any = None  # torchft's DiLoCo / LocalSGD, entered at the first step
        self.step_start: dict[str, Any] = {}  # `states` as the current step found them
        self.resumed_at = 0  # the checkpoint's step this start resumed at (0: none)
        self.inner_steps = 0  # semi-sync: optimizer steps taken, a sync every sync_steps of them

    # -- healing: what a live group sends, what a joining group applies -----------------

    def _state(self) -> dict[str, Any]:
        optimizer = self.optimizer.state_dict()
        # new dicts of local shards: the optimizer's own state stays as it is
        optimizer["state"] = {i: {k: local_tensor(v) for k, v in s.items()} for i, s in optimizer["state"].items()}
        return {
            # parameters and persistent buffers (the expert biases), as this rank's shards
            "model": {name: local_tensor(t.detach()) for name, t in self.model.state_dict(keep_vars=True).items()},
            "optimizer": optimizer,
            # per-step mode: the state before this step drew its batches (also while it is redone);
            # DiLoCo / local SGD heal at a sync, inside the optimizer step: the state as it is
            **(self.step_start or {name: piece.state_dict() for name, piece in self.states.items()}),
        }

    def _load(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, t in self.model.state_dict(keep_vars=True).items():
                local_tensor(t.detach()).copy_(state["model"][name])
        optimizer = state["optimizer"]
        for index, values in optimizer["state"].items():
            values.update({key: _like_param(value, self.params[int(index)]) for key, value in values.items()})
        self.optimizer.load_state_dict(optimizer)
        for name, piece in self.states.items():
            piece.load_state_dict(state[name])
        self.healed_at = int(state["train_state"]["step"]) if "train_state" in state else -1

    def resume(self, step: int) -> None:
        """After a checkpoint load: the manager's step count is the checkpoint's, so a group
        restarted alone (from an older checkpoint) heals from the live ones instead."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.ft.group_size})
        self.resumed_at = step

    # -- the step -------------------------------------------------------------------------

    def before_step(self, step: int, redo: bool = False) -> None:
        """Before step `step` draws its batches (or, `redo`, draws them again after a peer
        failed during it): the quorum, waiting while it has fewer than min_replica_size groups
        (up to quorum_timeout_ms); a joining group heals here, taking a live group's step, data
        position and RNG. One line when the quorum changed."""
        if not self.per_step:
            if self.semi_sync is None:
                self.semi_sync = _semi_sync(self.ft, self.manager, self.model, self.optimizer)
            return
        if redo:
            logger.info(f"fault_tolerance: step {step}: a peer group failed during it; redone by the new quorum")
        else:  # what a heal sends: the state before this step drew its batches, also while it is redone
            self.step_start = {name: piece.state_dict() for name, piece in self.states.items()}
        deadline = time.monotonic() + self.ft.quorum_timeout_ms / 1000
        self._quorum(step)
        while (error := self.manager.errored()) is not None:  # a heal or a reconfiguration failed: a peer died
            logger.info(f"fault_tolerance: step {step}: the quorum failed ({_first_line(error)}); asking again")
            self._quorum(step, deadline)
        while self.manager.num_participants() < self.ft.min_replica_size:
            if not self.waiting:
                logger.info(
                    f"fault_tolerance: step {step}: {self.manager.num_participants()}/{self.ft.group_size} groups, "
                    f"fewer than min_replica_size {self.ft.min_replica_size}: waiting for more"
                )
                self.waiting = True
            time.sleep(0.5)
            self._quorum(step, deadline)
        self._say_quorum(step)

    def _quorum(self, step: int, deadline: float = math.inf) -> None:
        """Ask for step `step`'s quorum (again: once more unless past `deadline`)."""
        line = (
            f"fault_tolerance: no quorum of min_replica_size {self.ft.min_replica_size} replica groups at step "
            f"{step} within quorum_timeout_ms {self.ft.quorum_timeout_ms} (lighthouse {os.environ.get(LIGHTHOUSE_ENV)})"
        )
        if time.monotonic() > deadline:
            raise TitanliteError(line)
        try:
            self.manager.start_quorum()
        except Exception as error:  # the lighthouse's deadline (a gRPC status) or a lost lighthouse
            raise TitanliteError(f"{line}: {_first_line(error)}") from None

    def _say_quorum(self, step: int) -> None:
        participants, groups, line = self.manager.num_participants(), self.ft.group_size, None
        if self.healed_at is not None:
            line = (
                f"step {self.healed_at + 1}: replica group {self.ft.replica_id} healed from a live group (model, "
                f"optimizer, data position, step {self.healed_at}); {participants}/{groups} groups"
            )
            if self.resumed_at:
                line += f"; the resume at step {self.resumed_at} is superseded"
            self.healed_at, self.resumed_at = None, 0
        elif self.waiting:
            line = f"step {step}: {participants}/{groups} groups; training goes on"
        elif self.participants and participants < self.participants:
            line = f"step {step}: quorum shrank to {participants}/{groups} replica groups; this group goes on"
        elif self.participants and participants > self.participants:
            line = f"step {step}: quorum grew to {participants}/{groups} replica groups (a group rejoined)"
        if line is not None:
            logger.info(f"fault_tolerance: {line}")
        self.participants, self.waiting = participants, False

    def after_backward(self, params: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """Average this rank's gradient shards and loss over the groups in the quorum (one
        all-reduce of one flat buffer); returns the averaged loss. MoE layers' token counts are
        summed over the quorum (int64: exact), so the expert-bias update, which sums them over
        dp x cp (step/experts.py), counts every group's tokens as HSDP's does. Under semi-sync:
        nothing."""
        if not self.per_step:
            return loss
        if self.experts is not None:
            counts = self.experts.token_counts(self.model)
            self.manager.allreduce(counts, reduce_op=ReduceOp.SUM).wait()
            self.experts.discount_tokens(self.model, self.experts.token_counts(self.model) - counts)
        grads = [local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p)) for p in params]
        whole_loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().reshape(1).clone()
        _average(self.manager, [*grads, whole_loss])  # loss parallel: the whole loss
        return whole_loss[0].to(loss.dtype)

    def after_optimizer_step(self, updated: bool) -> None:
        """Semi-sync: right after each sync (in the optimizer step) and the expert-bias update that
        follows it, the floating buffers (expert biases) averaged over that sync's quorum, as
        torchft's sync averages the parameters; between syncs each group balances its experts
        alone. A failed average (a peer died) keeps this group's own until the next sync."""
        self.inner_steps += updated
        synced = not self.per_step and updated and self.inner_steps % self.ft.sync_steps == 0
        buffers = [local_tensor(b) for b in self.model.buffers() if b.is_floating_point()]  # not RoPE's complex table
        if synced and buffers:
            _average(self.manager, buffers)

    def commit(self, step: int) -> bool:
        """Whether every group of the quorum may take this step (torchft's should_commit;
        False when a peer failed during it or fewer than min_replica_size groups joined)."""
        return self.manager.should_commit() if self.per_step else True

    def saves_checkpoints(self) -> bool:
        """One group writes the job's checkpoints: the first of the quorum (replica 0 before any
        quorum). A whole-job restart resumes from them; a group restarted alone heals instead."""
        rank = self.manager.participating_rank()
        return rank == 0 if rank is not None else self.ft.replica_id == 0

    def log_fields(self) -> list[LineField]:
        """`quorum 2/2`: groups in the last quorum / configured groups; the scalar `quorum`. Nothing
        before the first quorum (semi-sync: until the first sync)."""
        participants = self.manager.num_participants()
        if not participants:
            return []
        return [LineField(f"quorum {participants}/{self.ft.group_size}", {"quorum": participants})]

    def close(self) -> None:
        if self.semi_sync is not None:
            self.semi_sync.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


def _start_manager(ft: FaultTolerance, load: Callable, state: Callable, rank: int, world_size: int) -> Any:
    """torchft's Manager for this group, which heals with `load` and `state`: rank 0 also starts
    its server, which joins the lighthouse."""
    from torchft import Manager
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
    process_group = (ProcessGroupGloo if ft.process_group == "gloo" else ProcessGroupNCCL)(timeout=timeout)
    # torchft's default transport, its http.server without the access line per heal (`"GET
    # /checkpoint/33/full HTTP/1.1" 200 -`; errors still logged): the heal line says it once
    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    transport._server.RequestHandlerClass.log_request = lambda *args, **kwargs: None
    try:
        return Manager(
            pg=process_group,
            load_state_dict=load,
            state_dict=state,
            min_replica_size=ft.min_replica_size,
            use_async_quorum=False,  # heal before the step draws its batches; DiLoCo needs it too
            timeout=timeout,
            quorum_timeout=timedelta(milliseconds=ft.quorum_timeout_ms),
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            replica_id=f"replica_{ft.replica_id}",
            init_sync=False,  # every group initializes the same weights from training.seed
            checkpoint_transport=transport,
        )
    except RuntimeError as error:  # torchft's Rust client: the lighthouse refused or timed out
        raise TitanliteError(
            f"fault_tolerance: the lighthouse {LIGHTHOUSE_ENV}={os.environ.get(LIGHTHOUSE_ENV)} is unreachable: "
            f"{str(error).split(';')[0]}"
        ) from None


def _semi_sync(ft: FaultTolerance, manager: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torchft's LocalSGD or DiLoCo over `optimizer`, entered (its hooks sync every sync_steps)."""
    from torchft.local_sgd import DiLoCo, LocalSGD

    if ft.semi_sync_method == "local_sgd":
        semi_sync = LocalSGD(manager, model, optimizer, sync_every=ft.sync_steps)
    else:
        outer = torch.optim.SGD(model.parameters(), lr=ft.outer_lr, momentum=ft.outer_momentum, nesterov=True)
        semi_sync = DiLoCo(manager, [model], optimizer, outer, sync_every=ft.sync_steps, pin_memory=False)
    semi_sync.__enter__()
    return semi_sync
