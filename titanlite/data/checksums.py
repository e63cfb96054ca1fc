"""CRC-32s of files, and of a prepared dataset's shards.

Reading a shard catches ids outside the vocabulary (token_shards.py), but a flipped bit
that leaves an id inside it trains silently. So the manifest records a CRC-32 of each
shard's .bin and .idx (and chat data's .mask) when the shard is written, and `python -m titanlite.data.verify` (or
`training.verify_data`, the first time a run reads a shard) compares them. Checkpoints
use the same `file_crc32` for their shard files (checkpoint/integrity.py): zlib's CRC-32,
read in 1 MiB blocks, so a file of any size costs 1 MiB of memory and a few hundred MB/s
of one core. Imports no torch: tokenizer workers of the prepare command write shards.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from titanlite.errors import TitanliteError

BLOCK_BYTES = 1 << 20
SHARD_FILES = ("bin", "idx")  # the keys of a manifest entry's "crc32": a shard's file suffixes


def file_crc32(path: str | os.PathLike) -> str:
    """CRC-32 of a file's bytes as 8 hex digits, streamed in 1 MiB blocks."""
    crc = 0
    buffer = bytearray(BLOCK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def shard_crc32(folder: Path, name: str, suffixes: tuple[str, ...] = SHARD_FILES) -> dict[str, str]:
    """What a manifest entry records of shard `name`: {"bin": CRC-32, "idx": CRC-32}, and
    {"mask": CRC-32} for chat data's loss mask."""
    return {suffix: file_crc32(folder / f"{name}.{suffix}") for suffix in suffixes}


def check_shard(folder: Path, name: str, recorded: dict[str, str], field: str) -> None:
    """Compare shard `name`'s files with the CRC-32s its manifest entry recorded; one line
    naming the first file that differs (or cannot be read) otherwise."""
    for suffix in recorded:
        path = folder / f"{name}.{suffix}"
        try:
            actual = file_crc32(path)
        except OSError as error:
            raise TitanliteError(f"{field}: cannot read {path} ({error.strerror or error})") from None
        if actual != recorded[suffix]:
            raise TitanliteError(
                f"{field}: {path} is corrupted: CRC-32 {actual}, the manifest records {recorded[suffix]}"
            )
