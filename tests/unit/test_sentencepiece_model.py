"""titanlite/data/tokenizers/sentencepiece_model.py: the shipped sentencepiece tokenizer (round trip,
byte fallback, bos/eos, compact on code) and scripts/train_tokenizer.py, which trains it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from titanlite.data import Tokenizer

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "assets" / "tokenizer" / "titanlite.model"

SAMPLES = [
    "Hello, world!",
    "def add(a, b):\n    return a + b\n\n\nclass X:\n\tpass  # tab and trailing spaces   ",
    "  leading spaces and  double  spaces ",
    "digits 1234567890 and 3.14159",
    "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🚀🐍✨",
    "\x00 control \x7f chars and \u200b zero width",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(SHIPPED))


def test_shipped_model_loads(tok):
    assert tok.vocab_size == 4096 and tok.kind == "sentencepiece"
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert len(tok.sha256) == 64
    assert SHIPPED.stat().st_size < 200_000


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text, bos=False, eos=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text)) == text  # bos/eos decode to nothing


def test_unicode_uses_byte_fallback(tok):
    ids = tok.encode("🐍", bos=False, eos=False)
    pieces = [tok.backend.sp.IdToPiece(i) for i in ids]
    assert pieces and all(p.startswith("<0x") for p in pieces if p != "▁")
    assert tok.decode(ids) == "🐍"


def test_bos_eos_placement(tok):
    body = tok.encode("some text", bos=False, eos=False)
    assert tok.encode("some text") == [tok.bos_id, *body, tok.eos_id]
    assert tok.encode("some text", bos=True, eos=False) == [tok.bos_id, *body]
    assert tok.encode("some text", bos=False, eos=True) == [*body, tok.eos_id]
    assert tok.bos_id not in body and tok.eos_id not in body
    assert tok.encode("") == [tok.bos_id, tok.eos_id]


def test_code_is_compact(tok):
    """Trained on Python's own sources: common code takes few tokens per character."""
    text = (REPO / "titanlite" / "data" / "loader.py").read_text()
    assert len(text) / len(tok.encode(text)) > 2.5


def test_train_script_makes_a_loadable_model(tmp_path):
    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO / "scripts" / "train_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "small.model"
    assert script.main(["--vocab-size", "400", "--max-sentences", "200", "--output", str(out)]) == 0
    tok = Tokenizer(str(out))
    assert tok.vocab_size == 400 and (tok.bos_id, tok.eos_id) == (1, 2)
    text = "import os\nprint(os.getcwd())  # ✓"
    assert tok.decode(tok.encode(text)) == text
