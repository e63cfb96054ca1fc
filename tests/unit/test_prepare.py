"""titanlite/data/prepare.py: a corpus prepared by 2 workers into token shards holds every
document's tokens and boundaries, a rerun of a finished folder changes nothing, other settings in
the same folder are refused. (Its command line, a killed worker and the first-use cache:
tests/runs/test_prepare.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.token_data import folder_bytes, prepared, tok  # noqa: F401 (fixtures)
from titanlite.data.prepare import prepare
from titanlite.data.sources import FilesSource
from titanlite.data.token_shards import TokenShards
from titanlite.errors import TitanliteError


def test_round_trip_tokens_and_document_boundaries(prepared, tok):
    folder, docs = prepared
    shards = TokenShards(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert len(manifest["shards"]) > 4 and manifest["dtype"] == "uint16"
    assert manifest["documents"] == len(docs) and manifest["tokens"] == shards.num_tokens
    assert manifest["tokenizer"] == {
        "file": "titanlite.model",
        "kind": "sentencepiece",
        "sha256": tok.sha256,
        "vocab_size": 4096,
        "bos_id": 1,
        "eos_id": 2,
    }
    encoded = [tok.encode(d) for d in docs]
    assert shards.read(0, shards.num_tokens).tolist() == [t for ids in encoded for t in ids]
    boundaries = []
    for index in range(len(shards.names)):
        offsets = shards.document_offsets(index)
        boundaries += [shards.starts[index] + int(o) for o in offsets[:-1]]
        assert int(offsets[-1]) == shards.starts[index + 1] - shards.starts[index]
    assert boundaries == list(np.cumsum([0] + [len(e) for e in encoded])[:-1])


def test_rerun_of_a_finished_folder_changes_nothing(prepared, tok):
    folder, _ = prepared
    before = folder_bytes(folder)
    manifest = prepare(FilesSource(str(folder.parent / "text")), tok, folder, workers=1, shard_chars=4000)
    assert manifest["tokens"] == TokenShards(folder).num_tokens and folder_bytes(folder) == before


def test_other_settings_in_the_same_folder_are_refused(prepared, tok):
    folder, _ = prepared
    with pytest.raises(TitanliteError, match=r"^OUTPUT: .* holds a preparation with other settings \(shard_chars\)"):
        prepare(FilesSource(str(folder.parent / "text")), tok, folder, workers=1, shard_chars=5000)
