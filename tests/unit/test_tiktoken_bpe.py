"""titanlite/data/tokenizers/tiktoken_bpe.py (Llama 3's tokenizer.model): the same ids as the
tiktoken library, the 256 specials after the ranks, Llama 3's 128,256, long runs cut but round
tripped, a bad rank line named."""

from __future__ import annotations

import pytest

from tests.helpers.tokenizer_files import SAMPLES, tiktoken_file, write_rank_file  # noqa: F401 (fixtures)
from titanlite.data.tokenizers import Tokenizer
from titanlite.data.tokenizers.tiktoken_bpe import LLAMA3_PATTERN, SPECIAL_TOKENS, split_long_runs
from titanlite.errors import TitanliteError


@pytest.mark.parametrize("text", SAMPLES)
def test_tiktoken_matches_the_reference_library(tiktoken_file, text):
    import tiktoken

    path, ranks = tiktoken_file
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    reference = tiktoken.Encoding(
        name="reference", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
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
    with pytest.raises(
        TitanliteError, match=r"model\.tokenizer_path: .*tokenizer\.model:\d+: not a tiktoken rank line"
    ):
        Tokenizer(str(path))
