"""titanlite/parallel/collectives.py on one process: rank-0 decisions, any-rank flags, the first
error, means and sums over a group, with no group (a world of one), with a one-rank gloo group,
and through the collectives themselves on that group (a world of one skips them, so the test
spreads it: the broadcast, all-gather and all-reduce run on gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from titanlite.errors import TitanliteError
from titanlite.parallel import collectives
from titanlite.parallel.collectives import any_rank, mean_over, on_rank0, raise_first, sum_over


def check_all(group) -> None:
    assert on_rank0(group, lambda: {"step": 3}) == {"step": 3}
    assert on_rank0(group, lambda: [1, 2], broadcast_result=False) == [1, 2]  # rank 0 keeps its own result

    def refuse():
        raise TitanliteError("checkpoint.folder: nope")

    with pytest.raises(TitanliteError, match="^checkpoint.folder: nope$"):
        on_rank0(group, refuse)
    assert any_rank(group, True) and not any_rank(group, False)
    raise_first(group, None)
    with pytest.raises(TitanliteError, match="^shard 3 is short$"):
        raise_first(group, "shard 3 is short")
    value = torch.tensor(4.0)
    assert mean_over(group, value).item() == 4.0 and sum_over(group, value).item() == 4.0


def test_without_a_group_every_decision_runs_here():
    check_all(None)


def test_on_a_one_rank_group_the_collective_path_gives_the_same():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        check_all(dist.group.WORLD)
        value = torch.tensor(2.0)
        assert mean_over(dist.group.WORLD, value) is not value  # a new tensor, the input untouched
    finally:
        dist.destroy_process_group()


def test_with_no_group_the_value_itself_and_other_errors_pass_through():
    value = torch.tensor(4.0)
    assert mean_over(None, value) is value and sum_over(None, value) is value

    def crash():
        raise ValueError("not a user error")

    with pytest.raises(ValueError, match="not a user error"):
        on_rank0(None, crash)  # only a TitanliteError travels; anything else is a bug, raised as it is


def test_the_collective_calls_themselves_run_on_a_one_rank_group(monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(collectives, "_spread", lambda group: True)
        check_all(dist.group.WORLD)
    finally:
        dist.destroy_process_group()
