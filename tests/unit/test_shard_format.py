"""titanlite/data/shard_format.py: the token dtype follows the vocabulary, a shard is its tokens and
its document index, and its manifest entry records the CRC-32s of both files."""

from __future__ import annotations

import zlib

import numpy as np

from titanlite.data import checksums
from titanlite.data.shard_format import DTYPES, complete_shard, token_dtype, write_shard


def test_dtype_follows_the_vocabulary(tmp_path):
    assert (token_dtype(4096), token_dtype(65_536), token_dtype(128_256)) == ("uint16", "uint16", "uint32")
    docs = [[1, 70_000, 128_255], [5]]
    entry = write_shard(tmp_path, 0, docs, "uint32")
    assert (entry["name"], entry["tokens"], entry["documents"]) == ("shard-00000", 4, 2)
    assert np.fromfile(tmp_path / "shard-00000.bin", dtype=DTYPES["uint32"]).tolist() == [1, 70_000, 128_255, 5]
    assert np.fromfile(tmp_path / "shard-00000.idx", dtype="<u8").tolist() == [0, 3, 4]


def test_a_shard_entry_records_the_crc32_of_its_files_and_a_resumed_preparation_the_same(tmp_path):
    entry = write_shard(tmp_path, 3, [[1, 2, 3], [4]], "uint16")
    tokens, offsets = np.array([1, 2, 3, 4], dtype="<u2"), np.array([0, 3, 4], dtype="<u8")
    assert entry["crc32"] == {
        "bin": f"{zlib.crc32(tokens.tobytes()):08x}",
        "idx": f"{zlib.crc32(offsets.tobytes()):08x}",
    }
    assert complete_shard(tmp_path, 3, "uint16") == entry  # a complete shard kept by a resumed preparation


def test_file_crc32_reads_in_blocks(tmp_path, monkeypatch):
    data = bytes(range(256)) * 40
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(checksums, "BLOCK_BYTES", 1000)  # 11 blocks, the last one short
    assert checksums.file_crc32(tmp_path / "f") == f"{zlib.crc32(data):08x}"
