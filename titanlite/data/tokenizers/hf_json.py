"""A Hugging Face `tokenizer.json`, through the `tokenizers` package.

A tokenizer.json does not say which tokens are bos and eos; a `tokenizer_config.json`
beside it does (its `bos_token` / `eos_token`), else the usual names among its added
tokens are used (`<|begin_of_text|>`, `<s>`, ... ). A tokenizer with none adds nothing.
Documents are encoded without the file's own post-processor (`add_special_tokens=False`):
titanlite adds bos/eos itself, the same way for every kind; and, where `tokenizers` has
`encode_special_tokens` (0.20 on), a special token's text inside a document is encoded
as the text it is, like the tiktoken kind does; a chat template's rendering (data/chat.py)
is read with its special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from titanlite.data.tokenizers.base import FIELD, missing_extra
from titanlite.errors import TitanliteError, one_line

BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


def _tokenizer_config(path: str) -> dict[str, Any]:
    """The `tokenizer_config.json` beside `path`, {} when there is none or it is not an object."""
    try:
        data = json.loads(Path(path).with_name("tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class HFTokenizerJSON:
    """Backend for `titanlite.data.tokenizers.Tokenizer`."""

    def __init__(self, path: str) -> None:
        try:
            import tokenizers
        except ImportError:
            raise missing_extra("Hugging Face tokenizer.json", "tokenizers", "tokenizers", path) from None
        try:
            self.tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise TitanliteError(
                f"{FIELD}: {path} is not a readable Hugging Face tokenizer.json ({one_line(e)})"
            ) from None
        if hasattr(self.tok, "encode_special_tokens"):
            self.tok.encode_special_tokens = True
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        config = _tokenizer_config(path)
        self.bos_id = self._find(config.get("bos_token"), BOS_NAMES)
        self.eos_id = self._find(config.get("eos_token"), EOS_NAMES)

    def _find(self, configured: Any, usual: tuple[str, ...]) -> int:
        """The configured token (a string or {"content": ...}) if the vocabulary has it, else the first usual name."""
        if isinstance(configured, dict):
            configured = configured.get("content")
        for name in ([configured] if isinstance(configured, str) and configured else []) + list(usual):
            if (token_id := self.tok.token_to_id(name)) is not None:
                return token_id
        return -1

    def encode_plain(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of a rendered conversation, read as transformers reads it:
        the special tokens' text the chat template wrote is those tokens."""
        toggles = hasattr(self.tok, "encode_special_tokens")
        if toggles:
            self.tok.encode_special_tokens = False
        try:
            encoding = self.tok.encode(text, add_special_tokens=False)
        finally:
            if toggles:
                self.tok.encode_special_tokens = True
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
