"""DCP read and write plans for Hugging Face folders (used by hf_io.py): where each slice a
rank holds comes from, or goes to, when HF stores a tensor in another layout than ours. Both
layouts are folded into DCP's own plans, so a rank reads and writes only the bytes of its
shards, whatever the shard boundaries, and no rank builds a tensor it does not hold.

- Rotary rows (Llama's q/k projections): ours rotate interleaved pairs, HF's halves, a
  permutation of rows inside each head. Our row 2i+j of a head is HF row j*d/2+i, so a
  shard's rows come from two runs of HF rows per head and land in every other row of the
  local shard (a strided view: the reader copies into it in place).
- Stacked tensors (the routed experts of an MoE layer): we hold E experts as one tensor
  [E, ...] (three parameters, one FSDP unit, one grouped matmul); HF stores each expert as its
  own tensor [...] under its own name (`model.layers.L.mlp.experts.E.gate_proj.weight`). A
  local shard at global offsets [e0, r0, c0] of sizes [n, r, c] (FSDP's shard of dim 0 holds
  whole experts; a shard of another dim holds a block of every expert) is n reads, one per
  expert e in e0 .. e0+n-1: rows r0.. and columns c0.. of HF tensor `names[e]` into slot
  e - e0 of the shard. Writing mirrors it: n write items, each expert's block saved under its
  HF name at offsets [r0, c0] of shape [...], which DCP's HF writer and the consolidation
  assemble into whole per-expert tensors from whichever ranks hold their pieces (replicas,
  as under HSDP or TP, are written once: DCP dedups equal items).

A save permutes the rotary rows before DCP writes them (`to_hf_rows`): each rank its own
shard's rows when every shard holds whole heads, else the tensor gathered whole.

tests/unit/test_hf_read_plan.py checks both against every shard boundary, and the real plan
of one rank of a large fake world.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadItemType, TensorWriteData, WriteItemType
from torch.distributed.tensor import DTensor, Replicate

from titanlite.errors import TitanliteError
from titanlite.model_spec import HFAdapter
from titanlite.parallel.collectives import any_rank
from titanlite.parallel.placement import local_tensor, shard_like


def local_chunks(obj: torch.Tensor) -> list[ChunkStorageMetadata]:
    """The global offsets and sizes of what this rank holds of `obj` (a plain tensor: all)."""
    if isinstance(obj, DTensor):
        if obj.device_mesh.get_coordinate() is None:
            return []  # a rank outside the tensor's mesh holds none of it
        return obj.__create_chunk_list__()
    return [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]


def rotary_row_reads(fqn: str, chunk: ChunkStorageMetadata, head_dim: int) -> list[ReadItem]:
    """The reads that fill one local shard of a q/k projection (our interleaved rows) from
    the whole HF tensor (rotate-half rows): per head the shard overlaps, one run of HF rows
    for the even rows of the shard and one for the odd ones."""
    (row0, col0), (rows, cols) = chunk.offsets, chunk.sizes
    half, reads = head_dim // 2, []
    for head in range(row0 // head_dim, (row0 + rows - 1) // head_dim + 1):
        base = head * head_dim
        lo, hi = max(row0, base), min(row0 + rows, base + head_dim)
        for parity in (0, 1):
            first = (lo - base - parity + 1) // 2  # the first pair index i with base+2i+parity >= lo
            last = (hi - base - parity - 1) // 2  # the last with base+2i+parity < hi
            if last < first:
                continue
            reads.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, chunk.offsets),
                    dest_offsets=torch.Size([base + 2 * first + parity - row0, 0]),
                    storage_index=MetadataIndex(fqn, torch.Size([0, 0])),
                    storage_offsets=torch.Size([base + parity * half + first, col0]),
                    lengths=torch.Size([last - first + 1, cols]),
                )
            )
    return reads


def stacked_reads(fqn: str, chunk: ChunkStorageMetadata, names: list[str]) -> list[ReadItem]:
    """The reads that fill one local shard of a stacked tensor `fqn` [E, ...] from the HF
    tensors `names` (one per slice along dim 0): one read per slice the shard covers, of the
    shard's block of that slice. `dest_offsets` is [slot in the shard, 0, ...]; `lengths`
    has the slice's dims (HFReadPlanner.transform_tensor picks the slot)."""
    first, rest = chunk.offsets[0], len(chunk.sizes) - 1
    return [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(fqn, chunk.offsets),
            dest_offsets=torch.Size([e - first] + [0] * rest),
            storage_index=MetadataIndex(names[e], torch.Size([0] * rest)),
            storage_offsets=torch.Size(chunk.offsets[1:]),
            lengths=torch.Size(chunk.sizes[1:]),
        )
        for e in _covered(chunk)
    ]


def stacked_writes(
    names: list[str], chunk: ChunkStorageMetadata, shape: torch.Size, properties: TensorProperties
) -> list[WriteItem]:
    """The write items of one local shard of a stacked tensor of global `shape` [E, ...]:
    each slice the shard covers, as its block of the HF tensor `names[e]` [...]."""
    offsets, sizes = torch.Size(chunk.offsets[1:]), torch.Size(chunk.sizes[1:])
    return [
        WriteItem(
            index=MetadataIndex(names[e], offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=properties,
                size=torch.Size(shape[1:]),
            ),
        )
        for e in _covered(chunk)
    ]


def _covered(chunk: ChunkStorageMetadata) -> range:
    """The slices along dim 0 one local shard of a stacked tensor covers (none if it is empty)."""
    return range(0) if 0 in chunk.sizes[1:] else range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])


class HFReadPlanner(DefaultLoadPlanner):
    """DCP's default read plan for the tensors HF stores as we do; the q/k projections of
    `head_dims` (HF name -> head dim) read through the RoPE row permutation, and the stacked
    tensors of `stacked` (our key -> the HF name of each slice along dim 0) from their
    per-slice HF tensors. Every HF tensor must be whole in the folder (one chunk)."""

    def __init__(self, head_dims: dict[str, int] | None = None, stacked: dict[str, list[str]] | None = None):
        super().__init__(allow_partial_load=False)
        self.head_dims, self.stacked = head_dims or {}, stacked or {}

    def _whole(self, name: str) -> None:
        if (stored := self.metadata.state_dict_metadata.get(name)) is None:
            raise TitanliteError(f"tensor {name} is missing")
        if len(stored.chunks) != 1:
            raise TitanliteError(
                f"tensor {name} is stored in {len(stored.chunks)} pieces; a Hugging Face folder holds whole tensors"
            )

    def create_local_plan(self) -> LoadPlan:
        plain = {k: v for k, v in self.state_dict.items() if k not in self.head_dims and k not in self.stacked}
        plan = create_default_local_load_plan(plain, self.metadata, True)
        items = list(plan.items)
        for fqn, head_dim in self.head_dims.items():
            self._whole(fqn)
            items += [
                read for chunk in local_chunks(self.state_dict[fqn]) for read in rotary_row_reads(fqn, chunk, head_dim)
            ]
        for fqn, names in self.stacked.items():
            for name in names:
                self._whole(name)
            items += [read for chunk in local_chunks(self.state_dict[fqn]) for read in stacked_reads(fqn, chunk, names)]
        return dataclasses.replace(plan, items=items)

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        if fqn in self.head_dims:
            (row, col), (rows, cols) = read_item.dest_offsets, read_item.lengths
            return tensor[row : row + 2 * rows - 1 : 2, col : col + cols]
        if fqn in self.stacked:
            block = tuple(slice(o, o + n) for o, n in zip(read_item.dest_offsets[1:], read_item.lengths))
            return tensor[read_item.dest_offsets[0]][block]
        return super().transform_tensor(read_item, tensor)


class HFWritePlanner(DefaultSavePlanner):
    """DCP's default write plan, except for the stacked tensors of `stacked` (our key -> the
    HF name of each slice along dim 0): each rank writes each slice its shard covers as that
    slice's own HF tensor (a view of the shard, copied by DCP's writer one at a time)."""

    def __init__(self, stacked: dict[str, list[str]]):
        super().__init__()
        self.stacked = stacked
        self.slots: dict[str, tuple[str, int]] = {}  # HF name -> (our key, slot in the local shard)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self.stacked]
        for fqn, names in self.stacked.items():
            obj = self.state_dict[fqn]
            properties = TensorProperties.create_from_tensor(local_tensor(obj))
            for chunk in local_chunks(obj):
                written = stacked_writes(names, chunk, obj.shape, properties)
                items += written
                self.slots.update({item.index.fqn: (fqn, slot) for slot, item in enumerate(written)})
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        if write_item.index.fqn not in self.slots:
            return super().resolve_data(write_item)
        fqn, slot = self.slots[write_item.index.fqn]
        return local_tensor(self.state_dict[fqn])[slot]


def to_hf_rows(
    values: dict[str, torch.Tensor],
    heads: dict[str, int],
    head_dim: int,
    adapter: HFAdapter,
    group: dist.ProcessGroup | None,
) -> dict[str, torch.Tensor]:
    """The q/k projections in HF's row order. Each rank permutes its own rows when every
    rank's shard holds whole heads (one all-reduce decides, so all ranks agree); otherwise
    the tensor is gathered and permuted whole, and saved once (replicated)."""

    split = any(c.offsets[0] % head_dim or c.sizes[0] % head_dim for k in heads for c in local_chunks(values[k]))
    per_rank = not any_rank(group, split)
    out = dict(values)
    for key, count in heads.items():
        value = values[key]
        if not isinstance(value, DTensor):
            out[key] = adapter.interleaved_to_half(value, count)
        elif per_rank:
            local = value.to_local()
            permuted = (
                adapter.interleaved_to_half(local, local.shape[0] // head_dim) if local.numel() else local.clone()
            )
            out[key] = shard_like(permuted, value)
        else:
            full = adapter.interleaved_to_half(value.full_tensor(), count)
            out[key] = DTensor.from_local(
                full, value.device_mesh, [Replicate()] * value.device_mesh.ndim, run_check=False
            )
    return out
