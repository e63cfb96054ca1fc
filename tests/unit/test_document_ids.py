"""Document ids of training windows (data/token_shards.py, windows.py, loader.py): read from
the shards' document indexes, numbered from 0 in each window, a shard boundary starting a
new document, and handed out with each batch only when asked for."""

from __future__ import annotations

import numpy as np
import torch

from titanlite.data.loader import TokenWindowLoader
from titanlite.data.shard_format import FORMAT, FORMAT_VERSION, write_manifest, write_shard
from titanlite.data.token_shards import TokenShards
from titanlite.data.windows import DatasetWindows, WindowStream


def prepared(folder, shards: list[list[list[int]]]) -> TokenShards:
    entries = [write_shard(folder, i, documents, "uint16") for i, documents in enumerate(shards)]
    write_manifest(
        folder,
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dtype": "uint16",
            "tokenizer": {"vocab_size": 100, "sha256": "x"},
            "shards": entries,
        },
    )
    return TokenShards(folder)


def test_document_ids_follow_the_index_and_the_shard_boundaries(tmp_path):
    shards = prepared(tmp_path, [[[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[10, 11], [12]]])
    assert shards.document_ids(0, 12).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 4]
    assert shards.document_ids(1, 4).tolist() == [0, 0, 1, 1]
    assert shards.document_ids(3, 2).tolist() == [0, 0]
    assert shards.document_ids(8, 4).tolist() == [0, 1, 1, 2]  # 9 | 10 11 (next shard) | 12
    assert shards.document_ids(0, 12).dtype == np.int32


def test_the_loader_hands_the_inputs_document_ids_only_when_asked(tmp_path):
    shards = prepared(tmp_path, [[[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]])
    stream = WindowStream([DatasetWindows(shards, 5, 0, 3, seed=None)], [1.0], "test")
    plain = TokenWindowLoader(stream, 3, 0, 1, prefetch=False)
    assert len(next(plain)) == 2
    with_documents = TokenWindowLoader(stream, 3, 0, 1, prefetch=False, documents=True)
    inputs, labels, documents = next(with_documents)
    assert inputs.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9], [11, 12, 13, 14]]
    assert documents.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert documents.dtype == torch.int32 and documents.shape == inputs.shape
