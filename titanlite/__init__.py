"""titanlite: a compact torchtitan-style framework for pretraining Llama models, and the
library its trainer is built from (docs/library.md): the same functions build a mesh,
parallelize, checkpoint and load data for a user's own model and loop.

Exports load lazily (PEP 562): `import titanlite` imports no torch, so the command line
checks a config before torch starts; the first use of a name imports its module.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "init_distributed": "titanlite.parallel.distributed",
    "build_mesh": "titanlite.parallel.mesh",
    "Meshes": "titanlite.parallel.mesh",
    "parallelize": "titanlite.parallel.parallelize",
    "FullyShardedDataParallel": "titanlite.compat.fsdp1",
    "clip_grad_norm_": "titanlite.parallel.grad_norm",
    "full_state_dict": "titanlite.parallel.state_dict",
    "load_full_state_dict": "titanlite.parallel.state_dict",
    "sharded_state_dict": "titanlite.parallel.state_dict",
    "load_sharded_state_dict": "titanlite.parallel.state_dict",
    "Checkpointer": "titanlite.checkpoint.checkpointer",
    "prepare": "titanlite.data.prepare",
    "build_source": "titanlite.data.sources",
    "Tokenizer": "titanlite.data.tokenizers",
    "prepared_loader": "titanlite.data.loader",
    "TokenWindowLoader": "titanlite.data.loader",
    "TitanliteError": "titanlite.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
