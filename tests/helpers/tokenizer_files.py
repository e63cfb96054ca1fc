"""Small tokenizer files for the tokenizer tests (not tests themselves): a tiktoken rank file and
a Hugging Face tokenizer.json trained here on a few samples (fixtures `tiktoken_file`, `hf_file`:
import them where used); nothing is downloaded."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

SAMPLES = [
    "Hello, world! It's a test.",
    "def add(a, b):\n    return a + b\n\n\nclass X:\n\tpass  # tab   ",
    "naïve café, Ελληνικά, 日本語, emoji 🚀",
    "numbers 1234567 and <|begin_of_text|> as plain text",
    "",
]
MERGES = [
    b"th",
    b"he",
    b"the",
    b" t",
    b" the",
    b"in",
    b"ing",
    b"er",
    b"es",
    b"re",
    b"on",
    b" a",
    b"an",
    b"st",
    b"  ",
    b"    ",
]


def write_rank_file(path: Path, extra: list[bytes]) -> dict[bytes, int]:
    """All 256 bytes, then `extra` tokens, as a tiktoken rank file; returns the ranks."""
    ranks = {bytes([b]): b for b in range(256)}
    for token in extra:
        ranks.setdefault(token, len(ranks))
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    return ranks


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory) -> tuple[Path, dict[bytes, int]]:
    pytest.importorskip("tiktoken")
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    return path, write_rank_file(path, MERGES)


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SAMPLES * 20 + ["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path
