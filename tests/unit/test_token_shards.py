"""titanlite/data/token_shards.py: reads across shard boundaries, one line for each bad prepared
folder, a corrupted token named by the read that meets it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.token_data import folder_bytes, prepared, tok  # noqa: F401 (fixtures)
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
