"""Preparation into token shards: the format round-trips, an interrupted run (kill -9 of a
worker mid-shard) resumes to identical files, the first-use cache, and one line for each
bad prepared folder."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.distributed import REPO
from titanlite.data.prepare import prepare
from titanlite.data.shard_format import DTYPES, token_dtype, write_shard
from titanlite.data.sources import FilesSource
from titanlite.data.token_shards import TokenShards
from titanlite.data.tokenizers import Tokenizer
from titanlite.errors import TitanliteError

SHIPPED = REPO / "assets" / "tokenizer" / "titanlite.model"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(SHIPPED))


def write_corpus(folder: Path, n: int = 120, seed: int = 0) -> list[str]:
    """A .jsonl of `n` documents of varied length, made of stdlib text; returns them."""
    words = Path(json.__file__).read_text().split()
    rng = random.Random(seed)
    docs = [" ".join(rng.choices(words, k=rng.randint(5, 300))) for _ in range(n)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith(("shard-", "manifest"))}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok) -> tuple[Path, list[str]]:
    """The corpus prepared by 2 workers into shards of about 4,000 characters."""
    root = tmp_path_factory.mktemp("prepared")
    docs = write_corpus(root / "text")
    prepare(FilesSource(str(root / "text")), tok, root / "out", workers=2, shard_chars=4000)
    return root / "out", docs


def test_round_trip_tokens_and_document_boundaries(prepared, tok):
    folder, docs = prepared
    shards = TokenShards(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert len(manifest["shards"]) > 4 and manifest["dtype"] == "uint16"
    assert manifest["documents"] == len(docs) and manifest["tokens"] == shards.num_tokens
    assert manifest["tokenizer"] == {"file": "titanlite.model", "kind": "sentencepiece", "sha256": tok.sha256,
                                     "vocab_size": 4096, "bos_id": 1, "eos_id": 2}
    encoded = [tok.encode(d) for d in docs]
    assert shards.read(0, shards.num_tokens).tolist() == [t for ids in encoded for t in ids]
    boundaries = []
    for index in range(len(shards.names)):
        offsets = shards.document_offsets(index)
        boundaries += [shards.starts[index] + int(o) for o in offsets[:-1]]
        assert int(offsets[-1]) == shards.starts[index + 1] - shards.starts[index]
    assert boundaries == list(np.cumsum([0] + [len(e) for e in encoded])[:-1])


def test_reads_across_shard_boundaries(prepared):
    shards = TokenShards(prepared[0])
    everything = shards.read(0, shards.num_tokens)
    for start in (0, shards.starts[1] - 3, shards.starts[2] - 1, shards.num_tokens - 100):
        assert np.array_equal(shards.read(start, 100), everything[start : start + 100])
    with pytest.raises(IndexError):
        shards.read(shards.num_tokens - 10, 11)


def test_dtype_follows_the_vocabulary(tmp_path):
    assert (token_dtype(4096), token_dtype(65_536), token_dtype(128_256)) == ("uint16", "uint16", "uint32")
    docs = [[1, 70_000, 128_255], [5]]
    assert write_shard(tmp_path, 0, docs, "uint32") == {"name": "shard-00000", "tokens": 4, "documents": 2}
    assert np.fromfile(tmp_path / "shard-00000.bin", dtype=DTYPES["uint32"]).tolist() == [1, 70_000, 128_255, 5]
    assert np.fromfile(tmp_path / "shard-00000.idx", dtype="<u8").tolist() == [0, 3, 4]


def test_rerun_of_a_finished_folder_changes_nothing(prepared, tok):
    folder, _ = prepared
    before = folder_bytes(folder)
    manifest = prepare(FilesSource(str(folder.parent / "text")), tok, folder, workers=1, shard_chars=4000)
    assert manifest["tokens"] == TokenShards(folder).num_tokens and folder_bytes(folder) == before


def test_other_settings_in_the_same_folder_are_refused(prepared, tok):
    folder, _ = prepared
    with pytest.raises(TitanliteError, match=r"^OUTPUT: .* holds a preparation with other settings \(shard_chars\)"):
        prepare(FilesSource(str(folder.parent / "text")), tok, folder, workers=1, shard_chars=5000)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_shard", r"shard-00002\.bin is missing"),
        ("truncated_shard", r"shard-00001\.bin is truncated or altered: \d[\d,]* bytes, the manifest says"),
        ("future_version", r"has format version 99; this titanlite reads version 1 and older"),
        ("no_manifest", r"is not a prepared dataset \(no manifest\.json; write one with python -m titanlite\.data\.prepare"),
    ],
)
def test_bad_prepared_folder_is_one_line(prepared, tmp_path, case, message):
    folder = tmp_path / "copy"
    folder.mkdir()
    for name, data in folder_bytes(prepared[0]).items():
        (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    if case == "missing_shard":
        (folder / "shard-00002.bin").unlink()
    elif case == "truncated_shard":
        path = folder / "shard-00001.bin"
        path.write_bytes(path.read_bytes()[:-7])
    elif case == "future_version":
        (folder / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    else:
        (folder / "manifest.json").unlink()
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*" + message) as info:
        TokenShards(folder)
    assert "\n" not in str(info.value)


def test_corrupted_token_is_refused_when_read(prepared, tmp_path):
    """Issue 9: bytes altered inside a shard (not truncated) give an id outside the
    vocabulary; the read that meets it names the shard instead of training to a NaN."""
    folder = tmp_path / "copy"
    folder.mkdir()
    for name, data in folder_bytes(prepared[0]).items():
        (folder / name).write_bytes(data)
    path = folder / "shard-00001.bin"
    raw = bytearray(path.read_bytes())
    raw[20:22] = (60_000).to_bytes(2, "little")
    path.write_bytes(bytes(raw))
    shards = TokenShards(folder)
    shards.read(0, 100)  # shard 0 is intact
    with pytest.raises(TitanliteError, match=r"shard-00001\.bin is corrupted: token 10 is id 60,000, outside the manifest's vocabulary of 4,096"):
        shards.read(shards.starts[1], 50)
