"""titanlite/data/shard_format.py: the token dtype follows the vocabulary, a shard is its tokens and
its document index."""

from __future__ import annotations

import numpy as np

from titanlite.data.shard_format import DTYPES, token_dtype, write_shard


def test_dtype_follows_the_vocabulary(tmp_path):
    assert (token_dtype(4096), token_dtype(65_536), token_dtype(128_256)) == ("uint16", "uint16", "uint32")
    docs = [[1, 70_000, 128_255], [5]]
    assert write_shard(tmp_path, 0, docs, "uint32") == {"name": "shard-00000", "tokens": 4, "documents": 2}
    assert np.fromfile(tmp_path / "shard-00000.bin", dtype=DTYPES["uint32"]).tolist() == [1, 70_000, 128_255, 5]
    assert np.fromfile(tmp_path / "shard-00000.idx", dtype="<u8").tolist() == [0, 3, 4]
