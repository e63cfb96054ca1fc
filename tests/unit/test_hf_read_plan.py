"""What each rank reads of a Hugging Face folder: only its own slices.

`hf_io.RotaryRowsPlanner` is DCP's load planner with the RoPE row permutation folded into
the reads of q/k. Checked exactly on every shard boundary of a small projection, then on
the real plan of one rank of a 70B run sharded FSDP 64 (a fake process group, the real
parallelize path, DCP's planner on the model's own sharded state dict): that rank's reads
add up to its own shard of every tensor, byte for byte, and land where the permutation says.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from titanlite.checkpoint import hf_io
from titanlite.models.llama import hf_adapter


def hf_row(row: int, head_dim: int) -> int:
    """Where our (interleaved) row of a q/k projection sits in HF's rotate-half layout."""
    head, within = divmod(row, head_dim)
    pair, parity = divmod(within, 2)
    return head * head_dim + parity * (head_dim // 2) + pair


def rows_read(reads, row0: int) -> dict[int, int]:
    """our global row -> the HF row it was read from, for a list of read items."""
    got = {}
    for item in reads:
        for k in range(item.lengths[0]):
            ours = row0 + item.dest_offsets[0] + 2 * k
            assert ours not in got, f"row {ours} read twice"
            got[ours] = item.storage_offsets[0] + k
    return got


def test_every_shard_boundary_reads_exactly_its_rows_from_their_hf_places():
    head_dim, rows = 8, 32
    for start in range(rows):
        for stop in range(start + 1, rows + 1):
            chunk = ChunkStorageMetadata(offsets=torch.Size([start, 0]), sizes=torch.Size([stop - start, 5]))
            reads = hf_io.rotary_row_reads("q", chunk, head_dim)
            assert rows_read(reads, start) == {r: hf_row(r, head_dim) for r in range(start, stop)}
            assert len(reads) <= 2 * math.ceil((stop - start) / head_dim) + 2  # two runs a head, at most


def test_the_permuted_reads_fill_a_shard_with_our_layout():
    """The planner's strided views, filled from an HF-layout tensor, give our rows."""
    ours = torch.arange(32 * 3, dtype=torch.float32).view(32, 3)
    hf = hf_adapter.interleaved_to_half(ours, 4)
    planner = hf_io.RotaryRowsPlanner({"q": 8})
    for start, stop in ((0, 32), (4, 20), (13, 14), (3, 29)):
        local = torch.zeros(stop - start, 3)
        chunk = ChunkStorageMetadata(offsets=torch.Size([start, 0]), sizes=local.shape)
        for item in hf_io.rotary_row_reads("q", chunk, 8):
            rows, cols = item.lengths
            planner.transform_tensor(item, local).copy_(hf[item.storage_offsets[0] : item.storage_offsets[0] + rows, :cols])
        assert torch.equal(local, ours[start:stop]), (start, stop)


def test_a_70b_rank_of_64_reads_only_its_own_bytes():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlite.build import build_on_meta, plan_run
    from titanlite.config.load import load_config

    rank, world = 37, 64
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        plan = plan_run(load_config(["--config", "llama_70b", "--parallelism.data_parallel_shard_degree", str(world),
                                    "--parallelism.tensor_parallel_degree", "1"]), world,
                        vocab_size=128256)
        model = build_on_meta(plan, plan.dims.build_mesh("cpu"))
        args = plan.model_args
        state = get_model_state_dict(model)
        names = hf_io.hf_names(list(state), hf_adapter, args)
        request = {name: state[key] for key, name in names.items()}
        stored = {name: TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), value.shape,
                                              [ChunkStorageMetadata(torch.Size([0] * value.dim()), value.shape)])
                  for name, value in request.items()}
        heads = {name: args.head_dim for key, name in names.items() if hf_adapter.rotary_heads(key, args)}
        planner = hf_io.RotaryRowsPlanner(heads)
        planner.set_up_planner(request, Metadata(state_dict_metadata=stored), is_coordinator=False)
        plan_items = planner.create_local_plan().items
    finally:
        dist.destroy_process_group()

    assert len(heads) == 2 * args.n_layers and args.n_kv_heads * args.head_dim // world < args.head_dim  # wk: under a head a rank
    read = {name: 0 for name in request}
    for item in plan_items:
        read[item.dest_index.fqn] += math.prod(item.lengths)
    own = {name: value.to_local().numel() for name, value in request.items()}
    assert read == own  # every tensor: exactly this rank's elements, no more
    whole = sum(value.numel() for value in request.values())
    assert sum(own.values()) * 2 < whole * 2 / world * 1.01  # ~1/64 of the 140 GB model, in bf16
    for name in heads:  # and the q/k rows come from where the permutation puts them
        (row0, _), = [tuple(c.offsets) for c in request[name].__create_chunk_list__()]
        got = rows_read([i for i in plan_items if i.dest_index.fqn == name], row0)
        assert got == {r: hf_row(r, args.head_dim) for r in range(row0, row0 + request[name].to_local().shape[0])}
