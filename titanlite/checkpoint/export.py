"""Getting weights out of (and into) our checkpoints in other formats.

- One `torch.save` file of the full, unsharded model state dict, which loads into a plain
  model with `load_state_dict`: gathered from a live parallel model on rank 0
  (`full_model_state_dict`, all ranks call it) or read from a DCP folder on one process
  (`read_dcp_model`, no model needed: the tensors' global shapes and dtypes come from
  DCP's own index).
- Hugging Face safetensors + config.json through the model's `hf_adapter` (`save_hf`,
  `load_hf`): the adapter knows the model's names, layouts and config keys; this module
  knows only the file format. safetensors is an optional dependency, imported only here.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from titanlite.checkpoint.commit import read_dcp_index
from titanlite.checkpoint.load_progress import files_with_progress
from titanlite.errors import TitanliteError, one_line, user_errors

HF_WEIGHTS_FILE = "model.safetensors"
HF_CONFIG_FILE = "config.json"


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """DCP warns on every no_dist call that it assumes one process; here that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def cast_floating(state_dict: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """The state dict with its floating-point tensors cast to `dtype` (None: unchanged)."""
    if dtype is None:
        return state_dict
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in state_dict.items()}


def full_model_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """The unsharded model state dict on rank 0's CPU (None on other ranks). Collective:
    every rank must call it, each contributes its shards to every full tensor."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return cast_floating(state, dtype) if rank == 0 else None


def read_dcp_tensors(folder: str | os.PathLike, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint whose key starts with `prefix`, at full (unsharded)
    shape, read on one process into tensors allocated from the index's global shapes."""
    folder = Path(folder)
    metadata = read_dcp_index(folder)
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)
    }
    with user_errors(f"{folder}: cannot read checkpoint"), single_process():
        dcp.load(state, storage_reader=FileSystemReader(folder), no_dist=True)
    return state


def read_dcp_model(folder: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full model weights of a DCP checkpoint folder, read on one process.

    Only the model's entries are read (not the optimizer's two extra copies); keys lose the
    "model." prefix, so the result loads into a plain model. Checkpoints that keep weights
    at top level (torchtitan's weights-only ones) work too.
    """
    folder = Path(folder)
    keys = read_dcp_index(folder).state_dict_metadata
    prefix = "model." if any(k.startswith("model.") for k in keys) else ""
    if not prefix and any(k.startswith("optimizer.") for k in keys):
        raise TitanliteError(f"{folder}: checkpoint has no model weights")
    state = read_dcp_tensors(folder, prefix)
    return cast_floating({k[len(prefix):]: v for k, v in state.items()}, dtype)


def dcp_to_full_file(folder: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype | None = None) -> int:
    """DCP folder -> one `torch.save` file of the model; returns the number of tensors."""
    state = read_dcp_model(folder, dtype)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return len(state)


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise TitanliteError("Hugging Face weights need the safetensors package: pip install safetensors") from None
    return safetensors.torch


def save_hf(state_dict: dict[str, torch.Tensor], args: Any, adapter: Any, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write `model.safetensors` + `config.json` that `LlamaForCausalLM.from_pretrained` reads."""
    st = _safetensors()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_state = adapter.to_hf(cast_floating(state_dict, dtype), args)
    dtype = dtype or next(iter(hf_state.values())).dtype
    st.save_file(hf_state, str(out_dir / HF_WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / HF_CONFIG_FILE).write_text(json.dumps(adapter.hf_config(args, dtype), indent=2) + "\n")
    return out_dir


def read_hf_tensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model folder (one file, or shards listed by
    `model.safetensors.index.json`, or all `*.safetensors`)."""
    st = _safetensors()
    folder = Path(folder)
    if not folder.is_dir():
        raise TitanliteError(f"checkpoint.initial_load_path: {folder} is not a folder of Hugging Face weights")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise TitanliteError(f"{folder}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files_with_progress(f"Hugging Face import from {folder}", folder, files):
        try:
            tensors.update(st.load_file(str(folder / name)))
        except Exception as error:
            raise TitanliteError(f"{folder / name}: cannot read safetensors ({one_line(error)})") from None
    return tensors


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / HF_CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TitanliteError(f"{path}: missing (a Hugging Face model folder needs its config.json)") from None
    except ValueError as error:
        raise TitanliteError(f"{path}: not valid JSON ({error})") from None


def load_hf(folder: str | os.PathLike, adapter: Any, args: Any) -> dict[str, torch.Tensor]:
    """A Hugging Face folder as our full state dict, checked against `args` first: a
    config that describes another model is one line naming the file, not a shape error."""
    wrong = adapter.check_hf_config(read_hf_config(folder), args)
    if wrong:
        raise TitanliteError(f"{Path(folder) / HF_CONFIG_FILE}: describes another model: {', '.join(wrong)}")
    try:
        return adapter.from_hf(read_hf_tensors(folder), args)
    except KeyError as error:
        raise TitanliteError(f"{folder}: unexpected tensor {error.args[0]!r} for this model") from None
