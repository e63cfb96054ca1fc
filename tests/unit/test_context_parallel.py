"""titanlite/parallel/context_parallel.py on one process: the load-balanced split covers the
window once and gives every rank the same causal attention work; the split of inputs follows
it; on a one-rank group the gather is the identity, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titanlite.parallel.context_parallel import ContextParallel, chunk_positions


@pytest.mark.parametrize("cp", [2, 4])
def test_chunks_cover_the_window_once_and_balance_causal_work(cp):
    seq_len = 16 * cp
    parts = [chunk_positions(seq_len, rank, cp) for rank in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq_len))
    # A causal query at position p attends p + 1 keys: every rank gets the same sum.
    work = {int((part + 1).sum()) for part in parts}
    assert len(work) == 1
    assert parts[0][:2].tolist() == [0, 1] and parts[0][-1].item() == seq_len - 1  # chunks 0 and 2cp-1


@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    dist.destroy_process_group()


def test_on_one_rank_the_split_keeps_everything_and_the_gather_is_the_identity(one_rank_group):
    context = ContextParallel(one_rank_group)
    tokens = torch.arange(12).view(2, 6)
    assert torch.equal(context.shard(tokens), tokens)
    assert context.positions(6, torch.device("cpu")).tolist() == list(range(6))
    k, v = torch.randn(2, 6, 3, 4, requires_grad=True), torch.randn(2, 6, 3, 4, requires_grad=True)
    gathered_k, gathered_v = context.gather((k, v), dim=1, memory_order=(0, 2, 1, 3))
    assert torch.equal(gathered_k, k) and torch.equal(gathered_v, v)
    assert gathered_k.transpose(1, 2).is_contiguous()  # each head's keys contiguous, as the kernels read them
    (gathered_k * 2 + gathered_v * 3).sum().backward()
    assert torch.equal(k.grad, torch.full_like(k, 2.0)) and torch.equal(v.grad, torch.full_like(v, 3.0))
    (row_major,) = context.gather((k,), dim=1)
    assert row_major.is_contiguous()
