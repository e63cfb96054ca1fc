"""The tokenizer: a sentencepiece model (the shipped `assets/tokenizer/titanlite.model`, a
Llama 2 `tokenizer.model`, or any sentencepiece model file).

Llama 3's `tokenizer.model` is a tiktoken BPE file, not sentencepiece; it is recognised
and refused with a clear message.
"""

from __future__ import annotations

import re
from pathlib import Path

import sentencepiece as spm

from titanlite.errors import TitanliteError, one_line

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?\n")


class Tokenizer:
    """`encode` adds bos/eos by default (one document = bos ... eos). A model without a
    bos or eos piece (id -1) simply adds nothing for it."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        p = Path(path)
        if not p.exists():
            raise TitanliteError(f"model.tokenizer_path: tokenizer file not found: {path}")
        if p.is_dir():
            raise TitanliteError(f"model.tokenizer_path: {path} is a directory, expected a sentencepiece .model file")
        try:
            with p.open("rb") as f:
                head = f.read(256)
        except OSError as e:
            raise TitanliteError(f"model.tokenizer_path: cannot read {path}: {e.strerror or e}") from None
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(model_file=str(p))
        except (OSError, RuntimeError, ValueError) as e:
            if _TIKTOKEN_LINE.match(head):
                raise TitanliteError(
                    f"model.tokenizer_path: {path} is a tiktoken BPE file (Llama 3); titanlite reads sentencepiece models only"
                ) from None
            raise TitanliteError(f"model.tokenizer_path: not a sentencepiece model: {path} ({one_line(e)})") from None
        if self.sp.GetPieceSize() == 0:
            raise TitanliteError(f"model.tokenizer_path: not a sentencepiece model: {path} (no pieces)")
        self.vocab_size: int = self.sp.GetPieceSize()
        self.bos_id: int = self.sp.bos_id()
        self.eos_id: int = self.sp.eos_id()
        self.pad_id: int = self.sp.pad_id()
        self._bos = [self.bos_id] if self.bos_id >= 0 else []
        self._eos = [self.eos_id] if self.eos_id >= 0 else []

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self.sp.EncodeAsIds(text)
        if bos and self._bos:
            ids = self._bos + ids
        if eos and self._eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; bos/eos and other control pieces decode to nothing."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.sp.DecodeIds(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"
