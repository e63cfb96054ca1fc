"""Token data for the data tests (not tests themselves): the shipped tokenizer, a small text
corpus prepared by the real `prepare` (fixtures `tok`, `prepared`: import them where used), and
synthetic prepared folders whose windows are told apart by their first token (`make_prepared`,
fixture `shards`) with the window streams over them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import REPO
from titanlite.data.prepare import prepare
from titanlite.data.shard_format import write_manifest, write_shard
from titanlite.data.sources import FilesSource
from titanlite.data.token_shards import TokenShards
from titanlite.data.tokenizers import Tokenizer
from titanlite.data.windows import DatasetWindows, WindowStream

SHIPPED = REPO / "assets" / "tokenizer" / "titanlite.model"
VOCAB = 4096
SEQ = 15  # windows of 16 tokens


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


def make_prepared(
    folder: Path, tokens: int, first: int = 0, sha256: str = "0" * 64, shard_tokens: int = 700
) -> TokenShards:
    """A prepared folder whose stream is `first, first+1, ...` (mod VOCAB): window w of it
    starts with a known id, so tests can tell windows apart by their first token."""
    folder.mkdir(parents=True)
    stream = [(first + i) % VOCAB for i in range(tokens)]
    entries = [
        write_shard(folder, k, [stream[a : a + shard_tokens]], "uint16")
        for k, a in enumerate(range(0, tokens, shard_tokens))
    ]
    write_manifest(
        folder,
        {
            "format": "titanlite-tokens",
            "format_version": 1,
            "dtype": "uint16",
            "source": "test",
            "tokens": tokens,
            "documents": len(entries),
            "shards": entries,
            "tokenizer": {"file": "t", "kind": "sentencepiece", "sha256": sha256, "vocab_size": VOCAB},
        },
    )
    return TokenShards(folder)


def change_a_token_inside_the_vocabulary(path: Path, token: int) -> None:
    """Flip the lowest bit of a uint16 shard's token `token`: another id of the vocabulary, so
    reads pass the vocabulary check and only the checksums tell (issue 28)."""
    raw = bytearray(path.read_bytes())
    raw[2 * token] ^= 1
    path.write_bytes(bytes(raw))


def drop_checksums(folder: Path) -> None:
    """Make `folder`'s manifest one written before shards had checksums."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["shards"]:
        del entry["crc32"]
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def shards(tmp_path) -> TokenShards:
    return make_prepared(tmp_path / "a", 16 * 200 + 5)  # 200 windows and a tail


def stream_of(shards: TokenShards, seed: int | None = 7) -> WindowStream:
    return WindowStream([DatasetWindows(shards, SEQ + 1, 0, 200, seed)], [1.0], "test")


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
