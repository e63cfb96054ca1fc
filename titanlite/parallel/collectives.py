"""Rank-0 decisions shared with every rank, over one process group.

Some decisions read the file system (which checkpoint to resume, is this shard truncated,
does this Hugging Face config match): rank 0 makes them alone, so every rank acts on one
view of the disk, and the others receive the answer. A user error found there must stop
every rank alike, with the same one line, rather than leave the others waiting in the next
collective: so the error travels instead of the result.

`group` None means one plain process without torch.distributed: the decision runs here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from titanlite.errors import TitanliteError

T = TypeVar("T")


def _spread(group: dist.ProcessGroup | None) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def on_rank0(group: dist.ProcessGroup | None, decide: Callable[[], T], *, broadcast_result: bool = True) -> T | None:
    """Run `decide` on the group's rank 0 only and return its result on every rank, or raise
    its `TitanliteError` on every rank. broadcast_result False: the other ranks get None
    (for results too large to pickle around, which rank 0 then sends its own way)."""
    result, error = None, None
    if group is None or dist.get_rank(group) == 0:
        try:
            result = decide()
        except TitanliteError as e:
            error = str(e)
    if _spread(group):
        payload = [(result if broadcast_result else None, error)]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        if dist.get_rank(group) != 0:
            result, error = payload[0]
    if error is not None:
        raise TitanliteError(error)
    return result


def any_rank(group: dist.ProcessGroup | None, flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one (collective)."""
    if not _spread(group):
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, group=group)
    return bool(value.item())


def raise_first(group: dist.ProcessGroup | None, error: str | None) -> None:
    """Every rank did its share of a check and found `error` (None: nothing wrong); raise
    the lowest failing rank's error as a `TitanliteError` on every rank (collective)."""
    errors = [error]
    if _spread(group):
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    if (first := next((e for e in errors if e is not None), None)) is not None:
        raise TitanliteError(first)


def mean_over(group: dist.ProcessGroup | None, value: torch.Tensor) -> torch.Tensor:
    """`value` averaged over the group's ranks (a new tensor; gloo has no AVG, so SUM / size).
    Group None: one rank, `value` itself."""
    return value if group is None else sum_over(group, value) / dist.get_world_size(group)


def sum_over(group: dist.ProcessGroup | None, value: torch.Tensor) -> torch.Tensor:
    """`value` summed over the group's ranks (a new tensor). Group None: `value` itself."""
    if group is None:
        return value
    total = value.clone()
    dist.all_reduce(total, group=group)
    return total
