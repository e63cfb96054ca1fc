"""Hugging Face model folders (safetensors + index + config.json), read and written through
DCP's `HuggingFaceStorageReader` / `HuggingFaceStorageWriter`, each rank touching only the
slices of the tensors it holds.

Load: the model's own (sharded) state dict is renamed to Hugging Face names and handed to
`dcp.load`; DCP plans one read per local shard, so an FSDP/TP/HSDP rank reads only its rows
and columns of each file. Where HF's layout differs from ours, hf_plan.py folds the
difference into the read plan: Llama's RoPE rows (a permutation inside each head) and
stacked tensors (an MoE layer's experts, one tensor [E, ...] here, one HF tensor per expert
there: a shard's reads come from the experts it covers). No rank materializes a tensor it
does not hold, whatever the shard boundaries.

Save: each rank permutes its own rows to HF's order (hf_plan.py; a shard that does not hold
whole heads cannot, so that tensor alone is gathered first: one q/k projection is the fixed buffer),
DCP writes each rank's shards (a stacked tensor's as per-expert tensors, hf_plan.py), and
the ranks then consolidate them into whole-tensor files (one output file per rank at a
time; no process holds more than one tensor of them) with `model.safetensors.index.json`.
One process writes the final files directly. The folder is written under a `.partial` name
and renamed when complete: never a half-written export.

The model's `hf_adapter` knows the names (whole, stacked, or state HF has no place for),
the rotary rows and config.json; this module knows the file format and the plan.
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

from titanlite.checkpoint.export import cast_floating, single_process
from titanlite.checkpoint.hf_plan import HFReadPlanner, HFWritePlanner, to_hf_rows
from titanlite.checkpoint.load_progress import HFProgressReader, HFProgressWriter
from titanlite.errors import TitanliteError, user_errors
from titanlite.model_spec import HF_CONFIG_FILE, DecoderArgs, HFAdapter, read_hf_config

HF_INDEX_FILE = "model.safetensors.index.json"
# transformers' default `max_shard_size` for save_pretrained.
DEFAULT_MAX_FILE_BYTES = 5 * 1024**3


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
        if stray := sorted(p for p in folder.glob("*.safetensors") if p.name not in set(names)):
            raise TitanliteError(
                f"{stray[0]}: {HF_INDEX_FILE} does not name this file, and every *.safetensors in the "
                "folder would be read; move it out of the folder"
            )
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TitanliteError(f"{folder}: no *.safetensors files")
    return files


def read_hf_shapes(folder: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """Every tensor's (shape, safetensors dtype, file), from the files' headers only. A
    tensor in two files is refused, naming both: DCP's reader would read both and keep
    either (a folder without an index, where every *.safetensors is read, most often)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise TitanliteError("Hugging Face weights need the safetensors package: pip install safetensors") from None
    found = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                headers = {key: f.get_slice(key) for key in f.keys()}
                pieces = {key: (tuple(p.get_shape()), p.get_dtype(), path) for key, p in headers.items()}
        except Exception as error:  # a truncated or foreign file: safetensors' own words
            raise TitanliteError(f"{path}: cannot read safetensors ({' '.join(str(error).split())})") from None
        if (twice := next((key for key in pieces if key in found), None)) is not None:
            raise TitanliteError(
                f"{path}: tensor {twice} is also in {found[twice][2]}; a Hugging Face folder holds each tensor in "
                f"one file{_every_file_note(Path(folder))}: move one of them out"
            )
        found.update(pieces)
    return found


def _every_file_note(folder: Path) -> str:
    """Why a file nobody meant to load is read: without an index every *.safetensors is."""
    if (folder / HF_INDEX_FILE).is_file():
        return ""
    return f" (the folder has no {HF_INDEX_FILE}, so every *.safetensors in it is read)"


def hf_names(keys: list[str], adapter: HFAdapter, args: DecoderArgs) -> dict[str, str]:
    """Our state-dict key -> its Hugging Face name, for the keys HF stores whole under one
    name. Left out: a tied head (its embedding, stored once), a stacked tensor (`stacked_hf_names`)
    and state HF's class has no place for (`adapter.zero_in_hf`)."""
    return {
        key: adapter.hf_name(key)
        for key in keys
        if not (adapter.tied_to(key, args) or adapter.zero_in_hf(key, args) or adapter.stacked_hf_names(key, args))
    }


def stacked_hf_names(keys: list[str], adapter: HFAdapter, args: DecoderArgs) -> dict[str, list[str]]:
    """Our key -> the HF name of each slice along its dim 0, for the tensors we hold stacked
    and HF stores one slice each (an MoE layer's experts)."""
    return {key: names for key in keys if (names := adapter.stacked_hf_names(key, args))}


def _by_hf_name(
    state_dict: dict[str, torch.Tensor], adapter: HFAdapter, args: DecoderArgs
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]], dict[str, int]]:
    """What DCP reads or writes, by HF name (a stacked tensor under our key; `stacked` maps it
    to its slices' names), and the rotary heads of each q/k projection by HF name (its rows
    are permuted on the way)."""
    names = hf_names(list(state_dict), adapter, args)
    stacked = stacked_hf_names(list(state_dict), adapter, args)
    by_name = {name: state_dict[key] for key, name in names.items()} | {key: state_dict[key] for key in stacked}
    heads = {name: count for key, name in names.items() if (count := adapter.rotary_heads(key, args))}
    return by_name, stacked, heads


def _expected(
    wanted: dict[str, tuple[int, ...]], adapter: HFAdapter, args: DecoderArgs
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (our key, the shape HF stores) of every tensor a folder must hold."""
    expected = {name: (key, tuple(wanted[key])) for key, name in hf_names(list(wanted), adapter, args).items()}
    for key, names in stacked_hf_names(list(wanted), adapter, args).items():
        expected.update({name: (key, tuple(wanted[key][1:])) for name in names})
    return expected


def check_hf_folder(
    folder: str | os.PathLike, adapter: HFAdapter, args: DecoderArgs, wanted: dict[str, tuple[int, ...]]
) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """Everything that can be wrong with a Hugging Face folder, as one line each, before any
    rank reads a tensor: config.json of another model, a shard the index names missing,
    a tensor missing, of the wrong shape, or unknown to this model. `wanted`: our key ->
    global shape. Returns what the headers hold (`read_hf_shapes`)."""
    folder = Path(folder)
    if wrong := adapter.check_hf_config(read_hf_config(folder), args):
        raise TitanliteError(f"{folder / HF_CONFIG_FILE}: describes another model: {', '.join(wrong)}")
    found = read_hf_shapes(folder)
    expected = _expected(wanted, adapter, args)
    for name, (key, needed) in expected.items():
        if name not in found:
            raise TitanliteError(f"{folder}: tensor {name} is missing (this model's {key})")
        shape, _, path = found[name]
        if shape != needed:
            part = "" if needed == tuple(wanted[key]) else f", {list(needed)} for each of its slices"
            raise TitanliteError(
                f"{path}: tensor {name} has shape {list(shape)}, this model's {key} is {list(wanted[key])}{part}"
            )
    known = set(expected) | {adapter.hf_name(k) for k in wanted if adapter.tied_to(k, args)}
    if unknown := sorted(k for k in found if k not in known and not adapter.ignored_hf_tensor(k, args)):
        raise TitanliteError(
            f"{found[unknown[0]][2]}: tensor {unknown[0]} is not part of this model{_every_file_note(folder)}"
        )
    return found


def _quiet(group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager:
    """One process by design: DCP's warning that it assumes so is silenced."""
    return single_process() if group is None else contextlib.nullcontext()


def load_hf_weights(
    state_dict: dict[str, torch.Tensor],
    folder: str | os.PathLike,
    adapter: HFAdapter,
    args: DecoderArgs,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Fill `state_dict` (our keys; plain tensors or this rank's DTensor shards) in place
    from a Hugging Face folder, each rank reading only its slices; state HF's class has no
    place for is zeroed (where HF's model acts as if it were zero). Collective over `group`
    (None: one process). Call `check_hf_folder` first, on one rank."""
    request, stacked, heads = _by_hf_name(state_dict, adapter, args)
    with torch.no_grad():
        for value in [value for key, value in state_dict.items() if adapter.zero_in_hf(key, args)]:
            value.zero_()
    with user_errors(f"{folder}: cannot load Hugging Face weights"), _quiet(group):
        reader, planner = HFProgressReader(folder), HFReadPlanner(dict.fromkeys(heads, args.head_dim), stacked)
        dcp.load(request, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)


def whole_model_shapes(model_class: Any, args: DecoderArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the whole model, built on meta (no memory): what a Hugging
    Face folder must hold, whichever part of the model a rank (a pipeline stage) has."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in model_class(args).state_dict().items()}


def read_hf_model(
    folder: str | os.PathLike, adapter: HFAdapter, args: DecoderArgs, model_class: Any
) -> dict[str, torch.Tensor]:
    """A Hugging Face folder as the full state dict of `model_class(args)`, on one process
    (convert_hf.py), read with the same checks and plan as a sharded load; tensors keep the
    files' dtype."""
    from torch.distributed.checkpoint._hf_utils import DTYPE_MAP

    wanted = whole_model_shapes(model_class, args)
    found = check_hf_folder(folder, adapter, args, wanted)
    dtypes = {
        key: DTYPE_MAP.get(found[name][1], torch.float32) for name, (key, _) in _expected(wanted, adapter, args).items()
    }
    state = {
        key: torch.empty(wanted[key], dtype=dtypes.get(key, torch.float32))
        for key in wanted
        if key in dtypes or adapter.zero_in_hf(key, args)
    }
    load_hf_weights(state, folder, adapter, args)
    for key in wanted:
        if (source := adapter.tied_to(key, args)) is not None:
            state[key] = state[source]
    return state


# Files `AutoTokenizer.from_pretrained` reads beside the tokenizer itself, copied when present.
_TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def tokenizer_files(tokenizer: Path) -> list[Path]:
    """The run's tokenizer file and the HF companions found beside it."""
    return [tokenizer] + [
        tokenizer.parent / n for n in _TOKENIZER_COMPANIONS if (tokenizer.parent / n).is_file() and n != tokenizer.name
    ]


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


def _global_sizes(
    values: dict[str, torch.Tensor], stacked: dict[str, list[str]], group: dist.ProcessGroup | None
) -> dict[str, int]:
    """Every HF tensor's whole size in bytes (each slice of a stacked tensor its own), over
    all ranks: a pipeline stage holds only its own layers, and the file plan must be the
    same everywhere."""
    sizes = {}
    for key, value in values.items():
        nbytes = value.numel() * value.element_size()  # a DTensor's numel is global
        sizes.update(dict.fromkeys(stacked[key], nbytes // len(stacked[key])) if key in stacked else {key: nbytes})
    if group is None:
        return sizes
    everyone: list[dict[str, int]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, sizes, group=group)
    return {name: size for ranks in everyone for name, size in ranks.items()}


def save_hf_weights(
    state_dict: dict[str, torch.Tensor],
    out_dir: str | os.PathLike,
    adapter: HFAdapter,
    args: DecoderArgs,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    extra_files: list[Path] = (),
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Path:
    """Write a folder `from_pretrained` reads: sharded safetensors with its index,
    config.json and `extra_files` (the tokenizer). Collective over `group` (None: one
    process); `state_dict` has our keys, plain tensors or this rank's DTensor shards."""
    out_dir = Path(out_dir)
    # Before any collective: every rank has the same args, and refuses alike.
    if problems := adapter.hf_export_problems(args):
        raise TitanliteError(f"{out_dir}: Hugging Face's model class cannot hold this model: {', '.join(problems)}")
    partial = out_dir.with_name(out_dir.name + ".partial")
    first = group is None or dist.get_rank(group) == 0
    if first:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    values, stacked, heads = _by_hf_name(state_dict, adapter, args)
    # A copy is a tensor of its own: safetensors refuses two names over one storage.
    values |= {copy: state_dict[key].clone() for key in state_dict for copy in adapter.copies(key, args)}
    values = cast_floating(values, dtype)
    if heads:  # the same on every rank (the same args): all of them take part, or none
        values = to_hf_rows(values, heads, args.head_dim, adapter, group)
    mapping = file_indices(_global_sizes(values, stacked, group), max_file_bytes)
    distributed = group is not None and dist.get_world_size(group) > 1
    with user_errors(f"{out_dir}: cannot write Hugging Face weights"), _quiet(group):
        _write_files(values, stacked, partial, mapping, group if distributed else None)
    if first:
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


def _write_files(
    values: dict[str, torch.Tensor],
    stacked: dict[str, list[str]],
    folder: Path,
    mapping: dict[str, int],
    group: dist.ProcessGroup | None,
) -> None:
    """DCP's HF writer: alone, the final files straight into `folder`; with a `group` of
    several ranks, each rank's shards into `folder/sharded`, then consolidated into
    whole-tensor files in `folder` (one output file per rank at a time)."""
    if group is None:
        writer = HFProgressWriter(folder, fqn_to_index_mapping=mapping)
        dcp.save(values, storage_writer=writer, planner=HFWritePlanner(stacked), no_dist=True)
        return
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    dist.barrier(group=group)  # the folder exists before any rank writes into it
    writer = HFProgressWriter(folder / "sharded", fqn_to_index_mapping=mapping, save_distributed=True)
    dcp.save(values, storage_writer=writer, planner=HFWritePlanner(stacked), process_group=group)
    consolidate_safetensors_files_on_every_rank(str(folder / "sharded"), str(folder), mapping, process_group=group)
