"""Data: tokenizers (sentencepiece, tiktoken, tokenizer.json), document sources, preparation
into token shards, and the loader that reads this dp rank's windows of prepared shards.

Exports load lazily (PEP 562), so a tokenizer worker process of `titanlite.data.prepare`
imports neither torch nor the loader.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Tokenizer": "titanlite.data.tokenizers",
    "TokenWindowLoader": "titanlite.data.loader",
    "build_dataloader": "titanlite.data.corpus",
    "open_corpus": "titanlite.data.corpus",
    "build_source": "titanlite.data.sources",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
