"""What the tokenizer front (`Tokenizer`, in this package's `__init__`) and its backends share:
the config field every error names, the interface a backend implements, and the one line for
a file whose library is not installed. The backends import this module, never the front, so
the front can import them without a cycle.
"""

from __future__ import annotations

from typing import Protocol

from titanlite.errors import TitanliteError

FIELD = "model.tokenizer_path"


class Backend(Protocol):
    """What each kind implements: ids without bos/eos, and text from ids."""

    vocab_size: int
    bos_id: int  # -1 when the tokenizer has none
    eos_id: int

    def encode_plain(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


def missing_extra(kind: str, package: str, extra: str, path: str) -> TitanliteError:
    """The one line for a tokenizer file whose library is not installed."""
    return TitanliteError(
        f"{FIELD}: {path} is a {kind} file; reading it needs the {package} package: pip install titanlite[{extra}]"
    )
