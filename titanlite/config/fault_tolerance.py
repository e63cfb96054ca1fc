"""The `fault_tolerance` section (torchtitan's keys, plus DiLoCo's outer optimizer) and the
combinations of its keys that cannot work; `sections.JobConfig` holds it. Its own module so the
sections file stays one screenful per section (titanlite/runtime/fault_tolerance.py uses it)."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.engine import option as _opt
from titanlite.errors import TitanliteError


@dataclass
class FaultTolerance:
    """Replica groups on torchft (docs/faults.md): each group is its own torchrun job; torchft's
    Manager runs the quorum, the cross-group gradient average, each step's commit and the healing
    of a group that rejoins. Keys as torchtitan's `fault_tolerance` section, plus the outer
    optimizer of semi-synchronous training."""

    enable: bool = _opt(False, "train as one replica group of a fault-tolerant job (needs the ft extra: torchft)")
    replica_id: int = _opt(0, "this replica group's number, in [0, group_size)", ge=0)
    group_size: int = _opt(0, "number of replica groups of the job (each reads its share of every global batch)", ge=0)
    min_replica_size: int = _opt(1, "fewest groups a step commits with; below it training waits", ge=1)
    process_group: str = _opt("gloo", "the cross-group process group torchft reconfigures", choices=("gloo", "nccl"))
    process_group_timeout_ms: int = _opt(
        10000, "timeout of the cross-group collectives, the commit and a heal's transfer (ms)", gt=0
    )
    quorum_timeout_ms: int = _opt(
        60000, "how long a step waits for a quorum (a group below min_replica_size waits this long) (ms)", gt=0
    )
    semi_sync_method: str = _opt(
        "none",
        "none: average gradients every step; diloco or local_sgd: train each group alone and sync every sync_steps",
        choices=("none", "diloco", "local_sgd"),
    )
    sync_steps: int = _opt(5, "with semi_sync_method: inner steps between two syncs", gt=0)
    outer_lr: float = _opt(0.7, "DiLoCo's outer SGD learning rate (Nesterov momentum, as in the DiLoCo paper)", gt=0)
    outer_momentum: float = _opt(0.9, "DiLoCo's outer SGD momentum", ge=0, lt=1)


def check_fault_tolerance(ft: FaultTolerance) -> None:
    """The combinations of the `fault_tolerance` keys that cannot work; raises TitanliteError."""
    if not ft.enable:
        return
    if ft.group_size < 1:
        raise TitanliteError(f"fault_tolerance.group_size: must be >= 1 when enable is true (got {ft.group_size})")
    if ft.replica_id >= ft.group_size:
        raise TitanliteError(
            f"fault_tolerance.replica_id: must be in [0, group_size {ft.group_size}) (got {ft.replica_id})"
        )
    if ft.min_replica_size > ft.group_size:
        raise TitanliteError(
            f"fault_tolerance.min_replica_size: {ft.min_replica_size} is more than group_size {ft.group_size}"
        )
