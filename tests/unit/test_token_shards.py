"""titanlite/data/token_shards.py: reads across shard boundaries, one line for each bad prepared
folder, a corrupted token named by the read that meets it, and with `verify` a shard whose
ids stay inside the vocabulary named by its checksums before its first read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.token_data import (
    change_a_token_inside_the_vocabulary,
    drop_checksums,
    folder_bytes,
    make_prepared,
    prepared,  # noqa: F401 (fixtures)
    tok,  # noqa: F401 (fixture)
)
from titanlite.data.token_shards import TokenShards
from titanlite.errors import TitanliteError


def test_reads_across_shard_boundaries(prepared):
    shards = TokenShards(prepared[0])
    everything = shards.read(0, shards.num_tokens)
    for start in (0, shards.starts[1] - 3, shards.starts[2] - 1, shards.num_tokens - 100):
        assert np.array_equal(shards.read(start, 100), everything[start : start + 100])
    with pytest.raises(IndexError):
        shards.read(shards.num_tokens - 10, 11)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_shard", r"shard-00002\.bin is missing"),
        ("truncated_shard", r"shard-00001\.bin is truncated or altered: \d[\d,]* bytes, the manifest says"),
        ("future_version", r"has format version 99; this titanlite reads version 1 and older"),
        (
            "no_manifest",
            r"is not a prepared dataset \(no manifest\.json; write one with python -m titanlite\.data\.prepare",
        ),
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
    with pytest.raises(
        TitanliteError,
        match=r"shard-00001\.bin is corrupted: token 10 is id 60,000, outside the manifest's vocabulary of 4,096",
    ):
        shards.read(shards.starts[1], 50)


CRC_MISMATCH = r"is corrupted: CRC-32 [0-9a-f]{8}, the manifest records [0-9a-f]{8}$"


def test_verify_refuses_a_shard_whose_ids_stay_inside_the_vocabulary(tmp_path):
    """Issue 28: an id changed to another valid id passes the vocabulary check and trains
    silently; with `verify` the first read of its shard names it, and only its shard."""
    folder = tmp_path / "a"
    intact = make_prepared(folder, 2100).read(700, 10)  # shards of 700 tokens
    change_a_token_inside_the_vocabulary(folder / "shard-00001.bin", 5)
    assert TokenShards(folder).read(700, 10)[5] == intact[5] ^ 1  # unverified: read as if nothing happened
    checked = TokenShards(folder, verify=True)
    checked.read(0, 700)  # the shards around it are intact
    checked.read(1400, 700)
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*/shard-00001\.bin " + CRC_MISMATCH):
        checked.read(690, 20)


def test_verify_checks_the_document_index_before_its_first_use(tmp_path):
    folder = tmp_path / "a"
    make_prepared(folder, 1400)
    path = folder / "shard-00000.idx"
    path.write_bytes(path.read_bytes()[:-8] + (699).to_bytes(8, "little"))  # one token fewer in the last document
    with pytest.raises(TitanliteError, match=r"/shard-00000\.idx " + CRC_MISMATCH):
        TokenShards(folder, verify=True).document_ids(0, 16)


def test_a_manifest_from_before_checksums_loads_and_verify_says_it_cannot_check_it(tmp_path, capsys):
    folder = tmp_path / "a"
    expected = make_prepared(folder, 1400).read(0, 1400)
    drop_checksums(folder)
    assert [entry.crc32 for entry in TokenShards(folder).entries] == [None, None]
    assert capsys.readouterr().err == ""
    assert np.array_equal(TokenShards(folder, verify=True).read(0, 1400), expected)
    assert capsys.readouterr().err.splitlines() == [
        f"titanlite: note: training.dataset_path: {folder}/manifest.json records no checksums (prepared before "
        "titanlite "
        "wrote them), so its shards are read unverified; prepare it again to add them"
    ]
