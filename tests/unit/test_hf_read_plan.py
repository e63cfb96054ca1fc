"""What each rank reads of a Hugging Face folder, and writes to one: only its own slices.

`hf_plan.HFReadPlanner` is DCP's load planner with two layouts folded into its reads: the
RoPE row permutation of Llama's q/k, and the stacked experts of an MoE layer (one tensor
[E, ...] here, one HF tensor per expert there); `HFWritePlanner` writes a stacked shard as
per-expert tensors. Checked exactly on every shard boundary of a small tensor, then on the
real plans of one rank of a 70B run sharded FSDP 64 and of a Qwen3-30B-A3B run sharded FSDP
48 (a fake process group, the real parallelize path, DCP's planners on the model's own
sharded state dict): that rank's reads add up to its own shard of every tensor, byte for
byte, from where the permutation says and from its own experts' tensors only.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from titanlite.checkpoint import hf_io, hf_plan
from titanlite.models.llama import llama3_hf as hf_adapter


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
            reads = hf_plan.rotary_row_reads("q", chunk, head_dim)
            assert rows_read(reads, start) == {r: hf_row(r, head_dim) for r in range(start, stop)}
            assert len(reads) <= 2 * math.ceil((stop - start) / head_dim) + 2  # two runs a head, at most


def test_the_permuted_reads_fill_a_shard_with_our_layout():
    """The planner's strided views, filled from an HF-layout tensor, give our rows."""
    ours = torch.arange(32 * 3, dtype=torch.float32).view(32, 3)
    hf = hf_adapter.interleaved_to_half(ours, 4)
    planner = hf_plan.HFReadPlanner({"q": 8})
    for start, stop in ((0, 32), (4, 20), (13, 14), (3, 29)):
        local = torch.zeros(stop - start, 3)
        chunk = ChunkStorageMetadata(offsets=torch.Size([start, 0]), sizes=local.shape)
        for item in hf_plan.rotary_row_reads("q", chunk, 8):
            rows, cols = item.lengths
            planner.transform_tensor(item, local).copy_(
                hf[item.storage_offsets[0] : item.storage_offsets[0] + rows, :cols]
            )
        assert torch.equal(local, ours[start:stop]), (start, stop)


def test_a_70b_rank_of_64_reads_only_its_own_bytes():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlite.build import build_on_meta, plan_run
    from titanlite.config.load import load_config

    rank, world = 37, 64
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        plan = plan_run(
            load_config(
                [
                    "--config",
                    "llama_70b",
                    "--parallelism.data_parallel_shard_degree",
                    str(world),
                    "--parallelism.tensor_parallel_degree",
                    "1",
                ]
            ),
            world,
            vocab_size=128256,
        )
        model = build_on_meta(plan, plan.dims.build_mesh("cpu"))
        args = plan.model_args
        state = get_model_state_dict(model)
        names = hf_io.hf_names(list(state), hf_adapter, args)
        request = {name: state[key] for key, name in names.items()}
        stored = {
            name: TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16),
                value.shape,
                [ChunkStorageMetadata(torch.Size([0] * value.dim()), value.shape)],
            )
            for name, value in request.items()
        }
        heads = {name: args.head_dim for key, name in names.items() if hf_adapter.rotary_heads(key, args)}
        planner = hf_plan.HFReadPlanner(heads)
        planner.set_up_planner(request, Metadata(state_dict_metadata=stored), is_coordinator=False)
        plan_items = planner.create_local_plan().items
    finally:
        dist.destroy_process_group()

    assert (
        len(heads) == 2 * args.n_layers and args.n_kv_heads * args.head_dim // world < args.head_dim
    )  # wk: under a head a rank
    read = {name: 0 for name in request}
    for item in plan_items:
        read[item.dest_index.fqn] += math.prod(item.lengths)
    own = {name: value.to_local().numel() for name, value in request.items()}
    assert read == own  # every tensor: exactly this rank's elements, no more
    whole = sum(value.numel() for value in request.values())
    assert sum(own.values()) * 2 < whole * 2 / world * 1.01  # ~1/64 of the 140 GB model, in bf16
    for name in heads:  # and the q/k rows come from where the permutation puts them
        ((row0, _),) = [tuple(c.offsets) for c in request[name].__create_chunk_list__()]
        got = rows_read([i for i in plan_items if i.dest_index.fqn == name], row0)
        assert got == {r: hf_row(r, args.head_dim) for r in range(row0, row0 + request[name].to_local().shape[0])}


def whole(shape: torch.Size) -> TensorStorageMetadata:
    """How DCP's HF reader describes a tensor a folder holds whole."""
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16),
        torch.Size(shape),
        [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))],
    )


def test_every_shard_of_a_stacked_tensor_reads_and_writes_its_experts_blocks():
    """Shards of a stacked [4, 6, 5] tensor, FSDP's of dim 0 (whole experts) and blocks of
    dim 1 alike: the reads fill each from the per-expert tensors it covers, and the writes
    name those experts' blocks at the shard's offsets."""
    ours = torch.arange(4 * 6 * 5, dtype=torch.float32).view(4, 6, 5)
    names = [f"expert{e}" for e in range(4)]
    hf = {name: ours[e].clone() for e, name in enumerate(names)}
    planner = hf_plan.HFReadPlanner(stacked={"w": names})
    properties = TensorProperties.create_from_tensor(ours)
    for e0 in range(4):
        for e1 in range(e0 + 1, 5):
            for r0, r1 in ((0, 6), (2, 5), (5, 6)):
                chunk = ChunkStorageMetadata(offsets=torch.Size([e0, r0, 0]), sizes=torch.Size([e1 - e0, r1 - r0, 5]))
                local = torch.zeros(chunk.sizes)
                reads = hf_plan.stacked_reads("w", chunk, names)
                assert [item.storage_index.fqn for item in reads] == names[e0:e1]
                for item in reads:
                    block = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                    planner.transform_tensor(item, local).copy_(hf[item.storage_index.fqn][block])
                assert torch.equal(local, ours[e0:e1, r0:r1]), (e0, e1, r0, r1)
                writes = hf_plan.stacked_writes(names, chunk, ours.shape, properties)
                assert [
                    (
                        w.index.fqn,
                        tuple(w.tensor_data.chunk.offsets),
                        tuple(w.tensor_data.chunk.sizes),
                        tuple(w.tensor_data.size),
                    )
                    for w in writes
                ] == [(n, (r0, 0), (r1 - r0, 5), (6, 5)) for n in names[e0:e1]]


def test_a_qwen3_moe_rank_of_48_reads_and_writes_only_its_own_experts():
    """Qwen3-30B-A3B at FSDP 48: 128 experts in FSDP chunks of 3, so rank 42 holds the last
    two (126, 127) of every stacked weight. Its read plan covers its own shard of every tensor
    exactly, taking the experts' bytes from those two experts' HF tensors only; its write
    plan names those two experts' tensors, whole, and no other expert."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlite.build import build_on_meta, plan_run
    from titanlite.config.load import load_config
    from titanlite.models.qwen3 import qwen3_hf

    rank, world = 42, 48
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        plan = plan_run(
            load_config(
                [
                    "--config",
                    "debug_model",
                    "--model.name",
                    "qwen3",
                    "--model.flavor",
                    "30B-A3B",
                    "--parallelism.data_parallel_shard_degree",
                    str(world),
                ]
            ),
            world,
            vocab_size=151936,
        ).with_compute_dtype("float32")
        state = get_model_state_dict(build_on_meta(plan, plan.dims.build_mesh("cpu")))
        args = plan.model_args
        names = hf_io.hf_names(list(state), qwen3_hf, args)
        stacked = hf_io.stacked_hf_names(list(state), qwen3_hf, args)
        request = {name: state[key] for key, name in names.items()} | {key: state[key] for key in stacked}
        stored = {name: whole(state[key].shape) for key, name in names.items()}
        stored |= {name: whole(state[key].shape[1:]) for key, split in stacked.items() for name in split}
        reader = hf_plan.HFReadPlanner({}, stacked)
        reader.set_up_planner(request, Metadata(state_dict_metadata=stored), is_coordinator=False)
        reads = reader.create_local_plan().items
        writer = hf_plan.HFWritePlanner(stacked)
        writer.set_up_planner(request, is_coordinator=False)
        writes = writer.create_local_plan().items
    finally:
        dist.destroy_process_group()

    assert len(stacked) == 3 * args.n_layers and all(len(split) == 128 for split in stacked.values())
    read = {name: 0 for name in request}
    for item in reads:
        read[item.dest_index.fqn] += math.prod(item.lengths)
    assert read == {name: value.to_local().numel() for name, value in request.items()}  # exactly its own elements
    for key, split in stacked.items():
        assert tuple(request[key].__create_chunk_list__()[0].offsets)[0] == 126
        assert [item.storage_index.fqn for item in reads if item.dest_index.fqn == key] == split[126:]
    expert_writes = [item for item in writes if item.index.fqn not in names.values()]
    assert sorted(item.index.fqn for item in expert_writes) == sorted(
        n for split in stacked.values() for n in split[126:]
    )
    assert all(
        item.type == WriteItemType.SHARD and item.tensor_data.chunk.sizes == item.tensor_data.size
        for item in expert_writes
    )
    assert not any(item.index.fqn in stacked for item in writes)  # never the stacked tensor under our own name
