"""Dtype names as the config and the scripts spell them, parsed in one place.

Config values are checked by their fields' choices (`sections.py`); code that needs the
torch dtype calls `torch_dtype(name)`. Kept apart from `parallel/` so the checkpoint package
and the scripts can parse a dtype without importing FSDP.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a validated name ("float32", "bfloat16", "float16")."""
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The config spelling of a torch dtype: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
