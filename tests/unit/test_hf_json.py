"""titanlite/data/tokenizers/hf_json.py (a Hugging Face tokenizer.json): the same ids as the
tokenizers library, bos and eos from tokenizer_config.json, one line for a malformed file."""

from __future__ import annotations

import pytest

from tests.helpers.tokenizer_files import SAMPLES, hf_file  # noqa: F401 (fixtures)
from titanlite.data.tokenizers import Tokenizer
from titanlite.errors import TitanliteError


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_json_matches_the_reference_library(hf_file, text):
    import tokenizers

    reference = tokenizers.Tokenizer.from_file(str(hf_file))
    reference.encode_special_tokens = True  # documents are plain text, specials included
    tok = Tokenizer(str(hf_file))
    ids = tok.encode(text, bos=False, eos=False)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert (tok.bos_id, tok.eos_id) == (
        reference.token_to_id("<|begin_of_text|>"),
        reference.token_to_id("<|end_of_text|>"),
    )
    assert tok.encode(text) == [tok.bos_id, *ids, tok.eos_id]
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True)


def test_tokenizer_config_names_bos_and_eos(hf_file, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(hf_file.read_bytes())
    (folder / "tokenizer_config.json").write_text(
        '{"bos_token": {"content": "<|end_of_text|>"}, "eos_token": "<|begin_of_text|>"}'
    )
    tok = Tokenizer(str(folder / "tokenizer.json"))
    reference = Tokenizer(str(hf_file))
    assert (tok.bos_id, tok.eos_id) == (reference.eos_id, reference.bos_id)


def test_malformed_json_is_one_line(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(
        TitanliteError,
        match=r"^model\.tokenizer_path: .*tokenizer\.json is not a readable Hugging Face tokenizer\.json",
    ) as info:
        Tokenizer(str(path))
    assert "\n" not in str(info.value)
