"""A sentencepiece model file (the shipped tokenizer, Llama 2's `tokenizer.model`)."""

from __future__ import annotations

import sentencepiece as spm

from titanlite.data.tokenizers.base import FIELD
from titanlite.errors import TitanliteError, one_line


class SentencePieceModel:
    """Backend for `titanlite.data.tokenizers.Tokenizer`."""

    def __init__(self, path: str) -> None:
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(model_file=path)
        except (OSError, RuntimeError, ValueError) as e:
            raise TitanliteError(
                f"{FIELD}: {path} is not a tokenizer file titanlite reads: not a sentencepiece model ({one_line(e)}), "
                "a tiktoken BPE rank file (Llama 3's tokenizer.model) or a Hugging Face tokenizer.json"
            ) from None
        if self.sp.GetPieceSize() == 0:
            raise TitanliteError(f"{FIELD}: {path} is not a sentencepiece model (no pieces)")
        self.vocab_size = self.sp.GetPieceSize()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()

    def encode_plain(self, texts: list[str]) -> list[list[int]]:
        # One thread: parallelism is the prepare command's worker processes (sentencepiece
        # would otherwise start a thread per core in every worker).
        return self.sp.Encode(texts, out_type=int, num_threads=1)

    def decode(self, ids: list[int]) -> str:
        return self.sp.DecodeIds(ids)
