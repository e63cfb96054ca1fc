"""The tokenizer: one interface over the three kinds of tokenizer file a Llama user has.

- a sentencepiece model (the shipped `assets/tokenizer/titanlite.model`, Llama 2's
  `tokenizer.model`), through `sentencepiece` (a core dependency);
- a tiktoken BPE rank file (Llama 3's `tokenizer.model`: one base64 token and its rank
  per line), through `tiktoken` (`pip install titanlite[tiktoken]`), with Llama 3's 256
  special tokens after its ranks;
- a Hugging Face `tokenizer.json`, through `tokenizers` (`pip install titanlite[tokenizers]`).

The kind is read from the file's first bytes, so `model.tokenizer_path` is the only
setting. The file's SHA-256 identifies the tokenizer in prepared datasets: data tokenized
by another tokenizer is refused instead of training on the wrong ids.
"""

from __future__ import annotations

import hashlib
import importlib
import re
from pathlib import Path

from titanlite.data.tokenizers.base import FIELD, Backend
from titanlite.errors import TitanliteError

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?\n")
# kind -> (module of this package, its backend class), imported only when a file of that kind is read
BACKENDS = {
    "sentencepiece": ("sentencepiece_model", "SentencePieceModel"),
    "tiktoken": ("tiktoken_bpe", "TiktokenBPE"),
    "tokenizer.json": ("hf_json", "HFTokenizerJSON"),
}


def detect_kind(head: bytes) -> str:
    """The kind of tokenizer file whose first bytes are `head` (sentencepiece is the
    binary protobuf, so it is whatever is neither JSON nor a rank file)."""
    if head.lstrip().startswith(b"{"):
        return "tokenizer.json"
    if _TIKTOKEN_LINE.match(head):
        return "tiktoken"
    return "sentencepiece"


class Tokenizer:
    """`encode` adds bos/eos by default (one document = bos ... eos); a tokenizer without a
    bos or eos token (id -1) simply adds nothing for it. `decode` drops special tokens."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        p = Path(path)
        if not p.exists():
            raise TitanliteError(f"{FIELD}: tokenizer file not found: {path}")
        if p.is_dir():
            raise TitanliteError(
                f"{FIELD}: {path} is a directory, expected a tokenizer file "
                "(sentencepiece .model, tiktoken tokenizer.model or tokenizer.json)"
            )
        try:
            content = p.read_bytes()
        except OSError as e:
            raise TitanliteError(f"{FIELD}: cannot read {path}: {e.strerror or e}") from None
        if not content:
            raise TitanliteError(f"{FIELD}: {path} is empty, expected a tokenizer file")
        self.sha256 = hashlib.sha256(content).hexdigest()
        self.kind = detect_kind(content[:256])
        module, backend = BACKENDS[self.kind]
        self.backend: Backend = getattr(importlib.import_module(f"{__name__}.{module}"), backend)(self.path)
        self.vocab_size, self.bos_id, self.eos_id = self.backend.vocab_size, self.backend.bos_id, self.backend.eos_id
        self._bos = [self.bos_id] if self.bos_id >= 0 else []
        self._eos = [self.eos_id] if self.eos_id >= 0 else []

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        return (self._bos if bos else []) + self.backend.encode_plain([text])[0] + (self._eos if eos else [])

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Each text as one document, bos + ids + eos: what preparation writes."""
        return [self._bos + ids + self._eos for ids in self.backend.encode_plain(texts)]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; bos/eos and other special tokens decode to nothing."""
        return self.backend.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, kind={self.kind}, vocab_size={self.vocab_size})"


# In a Hugging Face model folder, the files a tokenizer can be read from, in order of preference.
ASSET_NAMES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")


def tokenizer_file(tokenizer_path: str, hf_assets_path: str = "") -> str:
    """The tokenizer file a run reads: `model.tokenizer_path`, or with `model.hf_assets_path`
    (torchtitan's key, a model folder) the first of ASSET_NAMES found in it."""
    if not hf_assets_path:
        return tokenizer_path
    folder = Path(hf_assets_path)
    if not folder.is_dir():
        raise TitanliteError(
            f"model.hf_assets_path: {hf_assets_path} is not a folder (it should hold the tokenizer files)"
        )
    for name in ASSET_NAMES:
        if (folder / name).is_file():
            return str(folder / name)
    raise TitanliteError(f"model.hf_assets_path: {hf_assets_path} holds no tokenizer file ({', '.join(ASSET_NAMES)})")
