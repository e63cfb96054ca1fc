"""The tiktoken (Llama 3) and Hugging Face tokenizer.json kinds: detected from the file,
consistent with their reference libraries, one line for what is missing or wrong.
The tests build their own small tokenizer files; nothing is downloaded."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

from titanlite.data.tokenizers import Tokenizer, detect_kind
from titanlite.data.tokenizers.tiktoken_bpe import LLAMA3_PATTERN, SPECIAL_TOKENS, split_long_runs
from titanlite.errors import TitanliteError

SAMPLES = [
    "Hello, world! It's a test.",
    "def add(a, b):\n    return a + b\n\n\nclass X:\n\tpass  # tab   ",
    "naïve café, Ελληνικά, 日本語, emoji 🚀",
    "numbers 1234567 and <|begin_of_text|> as plain text",
    "",
]
MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"er", b"es", b"re", b"on", b" a", b"an", b"st", b"  ", b"    "]


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
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLES * 20 + ["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_kind_is_read_from_the_file(tiktoken_file, hf_file):
    assert detect_kind(tiktoken_file[0].read_bytes()[:256]) == "tiktoken"
    assert detect_kind(hf_file.read_bytes()[:256]) == "tokenizer.json"
    assert Tokenizer(str(tiktoken_file[0])).kind == "tiktoken"
    assert Tokenizer(str(hf_file)).kind == "tokenizer.json"


@pytest.mark.parametrize("text", SAMPLES)
def test_tiktoken_matches_the_reference_library(tiktoken_file, text):
    import tiktoken

    path, ranks = tiktoken_file
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    reference = tiktoken.Encoding(name="reference", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    tok = Tokenizer(str(path))
    ids = tok.encode(text, bos=False, eos=False)
    assert ids == reference.encode_ordinary(text)
    assert tok.encode(text) == [tok.bos_id, *ids, tok.eos_id]
    assert tok.decode(tok.encode(text)) == text == reference.decode(ids)


def test_tiktoken_specials_follow_the_ranks(tiktoken_file):
    path, ranks = tiktoken_file
    tok = Tokenizer(str(path))
    assert len(SPECIAL_TOKENS) == 256 and len(set(SPECIAL_TOKENS)) == 256
    assert tok.vocab_size == len(ranks) + 256
    assert (tok.bos_id, tok.eos_id) == (len(ranks), len(ranks) + 1)


def test_llama3_sized_rank_file_gives_128256(tmp_path):
    pytest.importorskip("tiktoken")
    path = tmp_path / "tokenizer.model"
    # 128,000 ranks like Llama 3's: the 256 bytes, then made-up 4-byte tokens
    write_rank_file(path, [b"\xff" + i.to_bytes(3, "big") for i in range(128_000 - 256)])
    tok = Tokenizer(str(path))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (128_256, 128_000, 128_001)
    assert tok.decode(tok.encode("plain text")) == "plain text"


def test_tiktoken_long_runs_are_cut_but_round_trip(tiktoken_file):
    text = "a" * 60_000 + " " * 30_000 + "b"
    assert [len(p) for p in split_long_runs(text)] == [25_000, 25_000, 10_000 + 25_000, 5_001]
    tok = Tokenizer(str(tiktoken_file[0]))
    assert tok.decode(tok.encode(text)) == text


def test_bad_rank_line_is_named(tmp_path, tiktoken_file):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(tiktoken_file[0].read_bytes()[:40] + b"\nnot base64!! x\n")
    with pytest.raises(TitanliteError, match=r"model\.tokenizer_path: .*tokenizer\.model:\d+: not a tiktoken rank line"):
        Tokenizer(str(path))


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_json_matches_the_reference_library(hf_file, text):
    import tokenizers

    reference = tokenizers.Tokenizer.from_file(str(hf_file))
    reference.encode_special_tokens = True  # documents are plain text, specials included
    tok = Tokenizer(str(hf_file))
    ids = tok.encode(text, bos=False, eos=False)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert (tok.bos_id, tok.eos_id) == (reference.token_to_id("<|begin_of_text|>"), reference.token_to_id("<|end_of_text|>"))
    assert tok.encode(text) == [tok.bos_id, *ids, tok.eos_id]
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True)


def test_tokenizer_config_names_bos_and_eos(hf_file, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(hf_file.read_bytes())
    (folder / "tokenizer_config.json").write_text('{"bos_token": {"content": "<|end_of_text|>"}, "eos_token": "<|begin_of_text|>"}')
    tok = Tokenizer(str(folder / "tokenizer.json"))
    reference = Tokenizer(str(hf_file))
    assert (tok.bos_id, tok.eos_id) == (reference.eos_id, reference.bos_id)


@pytest.mark.parametrize("module, extra, name", [("tiktoken", "tiktoken", "tokenizer.model"), ("tokenizers", "tokenizers", "tokenizer.json")])
def test_missing_library_names_the_extra(monkeypatch, tiktoken_file, hf_file, module, extra, name):
    path = tiktoken_file[0] if name == "tokenizer.model" else hf_file
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(TitanliteError, match=rf"^model\.tokenizer_path: .*pip install titanlite\[{extra}\]$") as info:
        Tokenizer(str(path))
    assert "\n" not in str(info.value)


def test_malformed_json_is_one_line(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(TitanliteError, match=r"^model\.tokenizer_path: .*tokenizer\.json is not a readable Hugging Face tokenizer\.json") as info:
        Tokenizer(str(path))
    assert "\n" not in str(info.value)
