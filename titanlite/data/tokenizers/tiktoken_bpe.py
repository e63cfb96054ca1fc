"""A tiktoken BPE rank file: Llama 3's `tokenizer.model` (128,000 ranks) or any file of
that format (a base64 token and its rank per line), through the `tiktoken` package.

As in Meta's Llama 3 reference tokenizer, the 256 special tokens follow the ranks, so
Llama 3's vocabulary is 128,000 + 256 = 128,256 with `<|begin_of_text|>` = 128000 (bos)
and `<|end_of_text|>` = 128001 (eos); the names are Llama 3.1's. Documents are encoded as
ordinary text: a document that contains the string "<|eot_id|>" gets the ids of those
characters, never the special token.
"""

from __future__ import annotations

import base64
import itertools
import re

from titanlite.data.tokenizers.base import FIELD, missing_extra
from titanlite.errors import TitanliteError

# Llama 3's pre-tokenizer pattern (the one of its reference tokenizer).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
    r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
SPECIAL_TOKENS = _NAMED_SPECIALS + [
    f"<|reserved_special_token_{i}|>" for i in range(2, 2 + NUM_SPECIAL_TOKENS - len(_NAMED_SPECIALS))
]

# tiktoken's BPE is quadratic in the length of one pre-tokenized piece; a run of this many
# letters (or spaces) is cut, as Meta's reference tokenizer cuts them.
MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(r"\s{%d}|\S{%d}" % (MAX_RUN_CHARS, MAX_RUN_CHARS))


def read_ranks(path: str) -> dict[bytes, int]:
    """token bytes -> rank, one `base64 rank` pair per line; a bad line is named."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:  # binascii.Error is one
                raise TitanliteError(
                    f"{FIELD}: {path}:{number}: not a tiktoken rank line (expected 'base64 rank')"
                ) from None
    return ranks


def split_long_runs(text: str) -> list[str]:
    """`text` cut inside any run of MAX_RUN_CHARS whitespace or non-whitespace characters."""
    cuts = [m.end() for m in _LONG_RUN.finditer(text)]
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)]) if b > a] or [text]


class TiktokenBPE:
    """Backend for `titanlite.data.tokenizers.Tokenizer`."""

    def __init__(self, path: str) -> None:
        try:
            import tiktoken
        except ImportError:
            raise missing_extra("tiktoken BPE (Llama 3 tokenizer.model)", "tiktoken", "tiktoken", path) from None
        ranks = read_ranks(path)
        if not ranks:
            raise TitanliteError(f"{FIELD}: {path} holds no tiktoken ranks")
        self.num_base_tokens = max(ranks.values()) + 1
        specials = {name: self.num_base_tokens + i for i, name in enumerate(SPECIAL_TOKENS)}
        try:
            self.encoding = tiktoken.Encoding(
                name=path, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
            )
        except ValueError as e:
            raise TitanliteError(f"{FIELD}: {path}: not a usable tiktoken rank file ({e})") from None
        self.vocab_size = self.num_base_tokens + len(SPECIAL_TOKENS)
        self.bos_id, self.eos_id = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]

    def encode_plain(self, texts: list[str]) -> list[list[int]]:
        out = []
        for text in texts:
            pieces = split_long_runs(text)
            if len(pieces) == 1:
                out.append(self.encoding.encode_ordinary(text))
            else:
                out.append([i for ids in self.encoding.encode_ordinary_batch(pieces) for i in ids])
        return out

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode([i for i in ids if i < self.num_base_tokens])
