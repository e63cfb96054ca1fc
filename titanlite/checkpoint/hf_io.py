"""Hugging Face model folders (safetensors + index + config.json), read and written through
DCP's `HuggingFaceStorageReader` / `HuggingFaceStorageWriter`, each rank touching only the
slices of the tensors it holds.

Load: the model's own (sharded) state dict is renamed to Hugging Face names and handed to
`dcp.load`; DCP plans one read per local shard, so an FSDP/TP/HSDP rank reads only its rows
and columns of each file. The RoPE layouts differ (ours rotates interleaved pairs, HF's
halves: see the adapter's docstring) by a permutation of rows inside each head, which
`RotaryRowsPlanner` folds into the read plan: our row 2i+j of a head is HF row j*d/2+i, so
a shard's rows come from two runs of HF rows per head and land in every other row of the
local shard. No rank materializes a tensor it does not hold, whatever the shard boundaries.

Save: each rank permutes its own rows to HF's order (a shard that does not hold whole heads
cannot, so that tensor alone is gathered first: one q/k projection is the fixed buffer), DCP
writes each rank's shards, and the ranks then consolidate them into whole-tensor files (one
output file per rank at a time; no process holds more than one tensor of them) with
`model.safetensors.index.json`. One process writes the final files directly. The folder is
written under a `.partial` name and renamed when complete: never a half-written export.

The model's `hf_adapter` knows the names, the rotary rows and config.json; this module knows
the file format and the plan.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor, Replicate

from titanlite.checkpoint.export import single_process
from titanlite.checkpoint.load_progress import HFProgressReader
from titanlite.errors import TitanliteError, user_errors

HF_CONFIG_FILE = "config.json"
HF_INDEX_FILE = "model.safetensors.index.json"
# transformers' default `max_shard_size` for save_pretrained.
DEFAULT_MAX_FILE_BYTES = 5 * 1024**3


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:
        raise TitanliteError("Hugging Face weights need the safetensors package: pip install safetensors") from None
    return safe_open


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / HF_CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TitanliteError(f"{path}: missing (a Hugging Face model folder needs its config.json)") from None
    except ValueError as error:
        raise TitanliteError(f"{path}: not valid JSON ({error})") from None


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a Hugging Face folder: those its index names (each must be
    there, and no other may be: DCP's Hugging Face reader reads every `*.safetensors` in the
    folder, so a stray file's tensors would be loaded, and win, without a word), or every
    `*.safetensors` when it has no index."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TitanliteError(f"{folder}: not a folder of Hugging Face weights")
    index = folder / HF_INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as error:
            raise TitanliteError(f"{index}: not a safetensors index ({error})") from None
        for name in names:
            if not (folder / name).is_file():
                raise TitanliteError(f"{folder / name}: missing, but {HF_INDEX_FILE} names it")
        stray = sorted(p for p in folder.glob("*.safetensors") if p.name not in set(names))
        if stray:
            raise TitanliteError(f"{stray[0]}: {HF_INDEX_FILE} does not name this file, and every *.safetensors in the "
                                 "folder would be read; move it out of the folder")
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TitanliteError(f"{folder}: no *.safetensors files")
    return files


def read_hf_shapes(folder: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """Every tensor's (shape, safetensors dtype, file), from the files' headers only."""
    safe_open = _safe_open()
    found = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    found[key] = (tuple(piece.get_shape()), piece.get_dtype(), path)
        except Exception as error:  # a truncated or foreign file: safetensors' own words
            raise TitanliteError(f"{path}: cannot read safetensors ({' '.join(str(error).split())})") from None
    return found


def hf_names(keys: list[str], adapter: Any, args: Any) -> dict[str, str]:
    """Our state-dict key -> its Hugging Face name, for the keys HF stores (a tied head is
    its embedding, stored once)."""
    return {key: adapter.hf_name(key) for key in keys if not adapter.tied_to(key, args)}


def check_hf_folder(folder: str | os.PathLike, adapter: Any, args: Any,
                    wanted: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """Everything that can be wrong with a Hugging Face folder, as one line each, before any
    rank reads a tensor: config.json of another model, a shard the index names missing,
    a tensor missing, of the wrong shape, or unknown to this model. `wanted`: our key ->
    global shape. Returns what the headers hold (`read_hf_shapes`)."""
    folder = Path(folder)
    wrong = adapter.check_hf_config(read_hf_config(folder), args)
    if wrong:
        raise TitanliteError(f"{folder / HF_CONFIG_FILE}: describes another model: {', '.join(wrong)}")
    found = read_hf_shapes(folder)
    names = hf_names(list(wanted), adapter, args)
    for key, name in names.items():
        if name not in found:
            raise TitanliteError(f"{folder}: tensor {name} is missing (this model's {key})")
        shape, _, path = found[name]
        if shape != tuple(wanted[key]):
            raise TitanliteError(f"{path}: tensor {name} has shape {list(shape)}, this model's {key} is {list(wanted[key])}")
    known = {adapter.hf_name(k) for k in wanted}
    unknown = sorted(k for k in found if k not in known and not adapter.ignored_hf_tensor(k, args))
    if unknown:
        raise TitanliteError(f"{found[unknown[0]][2]}: tensor {unknown[0]} is not part of this model")
    return found


def _local_chunks(obj: torch.Tensor) -> list[ChunkStorageMetadata]:
    if isinstance(obj, DTensor):
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
            reads.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, chunk.offsets),
                dest_offsets=torch.Size([base + 2 * first + parity - row0, 0]),
                storage_index=MetadataIndex(fqn, torch.Size([0, 0])),
                storage_offsets=torch.Size([base + parity * half + first, col0]),
                lengths=torch.Size([last - first + 1, cols]),
            ))
    return reads


class RotaryRowsPlanner(DefaultLoadPlanner):
    """DCP's default plan, except for the q/k projections (`head_dims`: HF name -> head
    dim), whose reads follow the RoPE row permutation and write every other row of the
    destination shard (a strided view: the reader copies into it in place)."""

    def __init__(self, head_dims: dict[str, int]):
        super().__init__(allow_partial_load=False)
        self.head_dims = head_dims

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.dest_index.fqn not in self.head_dims]
        for fqn, head_dim in self.head_dims.items():
            obj, stored = self.state_dict[fqn], self.metadata.state_dict_metadata[fqn]
            if len(stored.chunks) != 1:
                raise TitanliteError(f"tensor {fqn} is stored in {len(stored.chunks)} pieces; a Hugging Face folder holds whole tensors")
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            for chunk in _local_chunks(obj):
                items += rotary_row_reads(fqn, chunk, head_dim)
        plan.items[:] = items
        return plan

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        if read_item.dest_index.fqn not in self.head_dims:
            return super().transform_tensor(read_item, tensor)
        (row, col), (rows, cols) = read_item.dest_offsets, read_item.lengths
        return tensor[row : row + 2 * rows - 1 : 2, col : col + cols]


def _quiet(group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager:
    """One process by design: DCP's warning that it assumes so is silenced."""
    return single_process() if group is None else contextlib.nullcontext()


def _group(group: dist.ProcessGroup | None) -> dict[str, Any]:
    return {"process_group": group} if group is not None else {"no_dist": True}


def load_hf_weights(state_dict: dict[str, torch.Tensor], folder: str | os.PathLike, adapter: Any, args: Any,
                    group: dist.ProcessGroup | None = None) -> None:
    """Fill `state_dict` (our keys; plain tensors or this rank's DTensor shards) in place
    from a Hugging Face folder, each rank reading only its slices. Collective over `group`
    (None: one process). Call `check_hf_folder` first, on one rank."""
    names = hf_names(list(state_dict), adapter, args)
    request = {name: state_dict[key] for key, name in names.items()}
    head_dims = {name: args.head_dim for key, name in names.items() if adapter.rotary_heads(key, args)}
    with user_errors(f"{folder}: cannot load Hugging Face weights"), _quiet(group):
        dcp.load(request, storage_reader=HFProgressReader(folder), planner=RotaryRowsPlanner(head_dims), **_group(group))


def whole_model_shapes(model_class: Any, args: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the whole model, built on meta (no memory): what a Hugging
    Face folder must hold, whichever part of the model a rank (a pipeline stage) has."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in model_class(args).state_dict().items()}


def read_hf_model(folder: str | os.PathLike, adapter: Any, args: Any, model_class: Any) -> dict[str, torch.Tensor]:
    """A Hugging Face folder as the full state dict of `model_class(args)`, on one process
    (convert_hf.py), read with the same checks and plan as a sharded load; tensors keep the
    files' dtype."""
    from torch.distributed.checkpoint._hf_utils import DTYPE_MAP

    wanted = whole_model_shapes(model_class, args)
    found = check_hf_folder(folder, adapter, args, wanted)
    names = hf_names(list(wanted), adapter, args)
    state = {key: torch.empty(wanted[key], dtype=DTYPE_MAP.get(found[name][1], torch.float32)) for key, name in names.items()}
    load_hf_weights(state, folder, adapter, args)
    for key in wanted:
        if (source := adapter.tied_to(key, args)) is not None:
            state[key] = state[source]
    return state


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def _to_hf_rows(values: dict[str, torch.Tensor], heads: dict[str, int], head_dim: int, adapter: Any,
                group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """The q/k projections in HF's row order. Each rank permutes its own rows when every
    rank's shard holds whole heads (one all-reduce decides, so all ranks agree); otherwise
    the tensor is gathered and permuted whole, and saved once (replicated)."""
    interleaved_to_half = adapter.interleaved_to_half

    def whole_heads(value: torch.Tensor) -> bool:
        return all(c.offsets[0] % head_dim == 0 and c.sizes[0] % head_dim == 0 for c in _local_chunks(value))

    local_ok = all(whole_heads(values[k]) for k in heads)
    everywhere = torch.tensor([int(local_ok)])
    if group is not None:
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=group)
    out = {}
    for key, value in values.items():
        if key not in heads:
            out[key] = value
        elif not isinstance(value, DTensor):
            out[key] = interleaved_to_half(value, heads[key])
        elif everywhere.item():
            local = value.to_local()
            permuted = interleaved_to_half(local, local.shape[0] // head_dim) if local.numel() else local.clone()
            out[key] = DTensor.from_local(permuted, value.device_mesh, value.placements, shape=value.shape, stride=value.stride(), run_check=False)
        else:
            full = interleaved_to_half(value.full_tensor(), heads[key])
            out[key] = DTensor.from_local(full, value.device_mesh, [Replicate()] * value.device_mesh.ndim, run_check=False)
    return out


# Files `AutoTokenizer.from_pretrained` reads beside the tokenizer itself, copied when present.
_TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def tokenizer_files(tokenizer: Path) -> list[Path]:
    """The run's tokenizer file and the HF companions found beside it."""
    return [tokenizer] + [tokenizer.parent / n for n in _TOKENIZER_COMPANIONS if (tokenizer.parent / n).is_file() and n != tokenizer.name]


def file_indices(sizes: dict[str, int], max_file_bytes: int) -> dict[str, int]:
    """HF name -> output file number (1..N), from each tensor's size in bytes: tensors in
    layer order, a new file whenever the next tensor would take the current one past
    `max_file_bytes` (transformers' rule)."""
    def order(name: str) -> tuple[int, str]:
        layer = re.search(r"\.layers\.(\d+)\.", name)
        return (int(layer.group(1)) + 1 if layer else (0 if "embed" in name else 1 << 30), name)

    mapping, current, used = {}, 1, 0
    for name in sorted(sizes, key=order):
        if used and used + sizes[name] > max_file_bytes:
            current, used = current + 1, 0
        mapping[name], used = current, used + sizes[name]
    return mapping


def _global_sizes(values: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> dict[str, int]:
    """Every tensor's whole size in bytes, over all ranks: a pipeline stage holds only its
    own layers, and the file plan must be the same everywhere."""
    sizes = {name: value.numel() * value.element_size() for name, value in values.items()}  # a DTensor's numel is global
    if group is None:
        return sizes
    everyone: list[dict[str, int]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, sizes, group=group)
    return {name: size for ranks in everyone for name, size in ranks.items()}


def save_hf_weights(state_dict: dict[str, torch.Tensor], out_dir: str | os.PathLike, adapter: Any, args: Any,
                    group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                    extra_files: list[Path] = (), max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Path:
    """Write a folder `from_pretrained` reads: sharded safetensors with its index,
    config.json and `extra_files` (the tokenizer). Collective over `group` (None: one
    process); `state_dict` has our keys, plain tensors or this rank's DTensor shards."""
    out_dir = Path(out_dir)
    partial = out_dir.with_name(out_dir.name + ".partial")
    rank = _rank(group)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    names = hf_names(list(state_dict), adapter, args)
    values = {name: (state_dict[key].to(dtype) if dtype is not None and state_dict[key].is_floating_point() else state_dict[key])
              for key, name in names.items()}
    heads = {name: count for key, name in names.items() if (count := adapter.rotary_heads(key, args))}
    values = _to_hf_rows(values, heads, args.head_dim, adapter, group)
    mapping = file_indices(_global_sizes(values, group), max_file_bytes)
    distributed = group is not None and dist.get_world_size(group) > 1
    with user_errors(f"{out_dir}: cannot write Hugging Face weights"), _quiet(group):
        if distributed:
            from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

            dist.barrier(group=group)  # the folder exists before any rank writes into it
            pieces = partial / "sharded"
            writer = HuggingFaceStorageWriter(str(pieces), fqn_to_index_mapping=mapping, save_distributed=True)
            dcp.save(values, storage_writer=writer, process_group=group)
            consolidate_safetensors_files_on_every_rank(str(pieces), str(partial), mapping, process_group=group)
        else:
            dcp.save(values, storage_writer=HuggingFaceStorageWriter(str(partial), fqn_to_index_mapping=mapping), no_dist=True)
    if rank == 0:
        shutil.rmtree(partial / "sharded", ignore_errors=True)
        floating = next((v.dtype for v in values.values() if v.is_floating_point()), torch.float32)
        (partial / HF_CONFIG_FILE).write_text(json.dumps(adapter.hf_config(args, floating), indent=2) + "\n")
        for path in extra_files:
            shutil.copy2(path, partial / Path(path).name)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(partial, out_dir)
    if distributed:
        dist.barrier(group=group)
    return out_dir
