"""Getting weights out of (and into) our checkpoints in other formats.

- One `torch.save` file of the full, unsharded model state dict, which loads into a plain
  model with `load_state_dict`: gathered from a live parallel model on rank 0
  (`full_model_state_dict`, all ranks call it) or read from a DCP folder on one process
  (`read_dcp_model`, no model needed: the tensors' global shapes and dtypes come from
  DCP's own index).

Hugging Face folders are `hf_io.py`'s (sharded, through DCP's HF storage reader/writer).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint import integrity
from titanlite.checkpoint.commit import dcp_tensors, read_commit, read_dcp_index
from titanlite.checkpoint.load_progress import ProgressReader
from titanlite.errors import TitanliteError, user_errors
from titanlite.logging import logger
from titanlite.observe.progress import amount_text
from titanlite.parallel.state_dict import full_state_dict


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
    state = full_state_dict(model)  # whole on rank 0's host, {} elsewhere
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return cast_floating(state, dtype) if rank == 0 else None


def read_dcp_tensors(folder: str | os.PathLike, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint whose key starts with `prefix`, at full (unsharded)
    shape, read on one process into tensors allocated from the index's global shapes, after
    the shard checksums its commit record holds (if any) are verified; progress lines say
    how far the read got (`load_progress`)."""
    folder = Path(folder)
    metadata = read_dcp_index(folder)
    record = read_commit(folder)
    integrity.verify(folder, record.checksums if record is not None else {}, None)
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in dcp_tensors(metadata, prefix).items()}
    with user_errors(f"{folder}: cannot read checkpoint"), single_process():
        dcp.load(state, storage_reader=ProgressReader(folder), no_dist=True)
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
    return cast_floating({k[len(prefix) :]: v for k, v in read_dcp_tensors(folder, prefix).items()}, dtype)


def dcp_to_full_file(folder: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype | None = None) -> int:
    """DCP folder -> one `torch.save` file of the model; returns the number of tensors."""
    state = read_dcp_model(folder, dtype)
    save_full_file(state, out)
    return len(state)


def save_full_file(state: dict[str, torch.Tensor], out: str | os.PathLike) -> None:
    """`torch.save` of a full state dict, said before it starts: one call, no progress to
    report inside it, and minutes for a large model."""
    size = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    logger.info(f"export: writing {len(state)} tensors ({amount_text(size, 'B')}) to {out}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
