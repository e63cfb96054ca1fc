"""titanlite/data/tokenizers/ (the Tokenizer front): the kind is read from the file, one line for
a missing path, a folder, a file of no known kind, an empty file, and a missing library (naming
the extra to install). Each kind: test_sentencepiece_model.py, test_tiktoken_bpe.py, test_hf_json.py."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.tokenizer_files import hf_file, tiktoken_file  # noqa: F401 (fixtures)
from titanlite.data.tokenizers import Tokenizer, detect_kind
from titanlite.errors import TitanliteError


def test_kind_is_read_from_the_file(tiktoken_file, hf_file):
    assert detect_kind(tiktoken_file[0].read_bytes()[:256]) == "tiktoken"
    assert detect_kind(hf_file.read_bytes()[:256]) == "tokenizer.json"
    assert Tokenizer(str(tiktoken_file[0])).kind == "tiktoken"
    assert Tokenizer(str(hf_file)).kind == "tokenizer.json"


def test_missing_path(tmp_path):
    path = tmp_path / "nope.model"
    with pytest.raises(TitanliteError, match=r"model\.tokenizer_path: .*not found.*nope\.model"):
        Tokenizer(str(path))


def test_directory(tmp_path):
    with pytest.raises(TitanliteError, match=r"model\.tokenizer_path: .*directory"):
        Tokenizer(str(tmp_path))


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.model"
    path.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(
        TitanliteError, match=r"model\.tokenizer_path: .*garbage\.model is not a tokenizer file titanlite reads"
    ) as info:
        Tokenizer(str(path))
    assert "\n" not in str(info.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.model"
    path.write_bytes(b"")
    with pytest.raises(TitanliteError, match=r"model\.tokenizer_path: .*empty\.model"):
        Tokenizer(str(path))


@pytest.mark.parametrize(
    "module, extra, name", [("tiktoken", "tiktoken", "tokenizer.model"), ("tokenizers", "tokenizers", "tokenizer.json")]
)
def test_missing_library_names_the_extra(monkeypatch, tiktoken_file, hf_file, module, extra, name):
    path = tiktoken_file[0] if name == "tokenizer.model" else hf_file
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(TitanliteError, match=rf"^model\.tokenizer_path: .*pip install titanlite\[{extra}\]$") as info:
        Tokenizer(str(path))
    assert "\n" not in str(info.value)
