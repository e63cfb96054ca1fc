"""Reading a prepared dataset: any token range by memory map, in O(1) of the corpus size.

Opening checks the manifest and every shard's file sizes (a missing or truncated shard is
one line naming the file) but maps nothing; a shard is mapped the first time a read
touches it, so a rank maps only the shards its windows fall in. Every read checks that its
ids are inside the manifest's vocabulary: a corrupted shard stops the run with one line
instead of an index error (CPU) or a device assert (CUDA), or a silent NaN.

Ids that stay inside the vocabulary pass that check, so with `verify` a shard's files are
also compared with the manifest's CRC-32s (checksums.py) the first time a read maps either
of them: the run pays one extra read of each shard it touches, and only of those.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from titanlite.data.checksums import check_shard
from titanlite.data.shard_format import DTYPES, MANIFEST, read_manifest
from titanlite.errors import TitanliteError, say_notices


class TokenShards:
    """One prepared folder as a single token stream (the shards concatenated in order)."""

    def __init__(self, folder: str | Path, field: str = "training.dataset_path", verify: bool = False) -> None:
        """`verify`: check each shard's CRC-32s before its first read (the module docstring)."""
        self.folder, self.field = Path(folder), field
        manifest = read_manifest(self.folder, field)
        self.manifest = manifest
        self.dtype = DTYPES[manifest["dtype"]]
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        self.entries = manifest["_entries"]
        self.chat = manifest.get("chat")  # chat data (data/chat.py): a loss mask beside the tokens
        self.names = [entry.name for entry in self.entries]
        self.shard_bytes = [self._check_files(entry.name, entry.tokens, entry.documents) for entry in self.entries]
        self.starts = list(itertools.accumulate((entry.tokens for entry in self.entries), initial=0))
        self.num_tokens = self.starts[-1]
        self._maps: dict[tuple[int, str], np.memmap] = {}
        self._unverified = {k for k, entry in enumerate(self.entries) if entry.crc32 is not None} if verify else set()
        if verify and len(self._unverified) < len(self.entries):
            say_notices(
                [
                    f"{field}: {self.folder / MANIFEST} records no checksums (prepared before titanlite wrote them), "
                    "so its shards are read unverified; prepare it again to add them"
                ]
            )

    def _check_files(self, name: str, tokens: int, documents: int) -> int:
        """The shard's .bin and .idx exist with the sizes the manifest implies; returns their sum."""
        sizes = {
            ".bin": tokens * self.dtype.itemsize,
            ".idx": (documents + 1) * 8,
            **({".mask": tokens} if self.chat else {}),
        }
        for suffix, size in sizes.items():
            path = self.folder / f"{name}{suffix}"
            try:
                actual = path.stat().st_size
            except OSError:
                raise TitanliteError(
                    f"{self.field}: {path} is missing (listed in {self.folder / 'manifest.json'})"
                ) from None
            if actual != size:
                raise TitanliteError(
                    f"{self.field}: {path} is truncated or altered: {actual:,} bytes, the manifest says {size:,}"
                )
        return sum(sizes.values())

    def _verify_once(self, shard: int) -> None:
        """Check the shard's CRC-32s if `verify` asked for it and no read has yet. Two threads
        (prefetch, validation) may both check a shard once; neither reads it unchecked."""
        if shard in self._unverified:
            entry = self.entries[shard]
            check_shard(self.folder, entry.name, entry.crc32, self.field)
            self._unverified.discard(shard)

    def _map(self, shard: int, suffix: str) -> np.memmap:
        """Shard `shard`'s tokens ("bin"), document offsets ("idx") or loss mask ("mask"), mapped on first use."""
        self._verify_once(shard)
        if (shard, suffix) not in self._maps:
            dtype = {"bin": self.dtype, "idx": "<u8", "mask": "u1"}[suffix]
            self._maps[shard, suffix] = np.memmap(self.folder / f"{self.names[shard]}.{suffix}", dtype=dtype, mode="r")
        return self._maps[shard, suffix]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, as int64 (a copy)."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens})")
        out = np.empty(length, dtype=np.int64)
        for shard, offset, take, done in self._pieces(start, length):
            piece = self._map(shard, "bin")[offset : offset + take]
            if int(piece.max()) >= self.vocab_size:
                at = offset + int(np.argmax(piece >= self.vocab_size))
                raise TitanliteError(
                    f"{self.field}: {self.folder / self.names[shard]}.bin is corrupted: token {at:,} is id "
                    f"{int(piece.max()):,}, outside the manifest's vocabulary of {self.vocab_size:,}"
                )
            out[done : done + take] = piece
        return out

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """Whether each of tokens [start, start + length) is trained (bool): all are, but in chat data."""
        if not self.chat:
            return np.ones(length, dtype=bool)
        out = np.empty(length, dtype=bool)
        for shard, offset, take, done in self._pieces(start, length):
            out[done : done + take] = self._map(shard, "mask")[offset : offset + take]
        return out

    def _pieces(self, start: int, length: int) -> Iterator[tuple[int, int, int, int]]:
        """(shard, offset in it, tokens taken, tokens before) for each shard the range
        [start, start + length) of the stream covers, in order (empty shards skipped)."""
        done = 0
        shard = bisect.bisect_right(self.starts, start) - 1
        while done < length:
            offset = start + done - self.starts[shard]
            if (take := min(length - done, self.starts[shard + 1] - self.starts[shard] - offset)) > 0:
                yield shard, offset, take, done
                done += take
            shard += 1

    def document_offsets(self, shard: int) -> np.ndarray:
        """Token offsets of shard `shard`'s documents within it (documents + 1 entries), mapped."""
        return self._map(shard, "idx")

    def document_ids(self, start: int, length: int) -> np.ndarray:
        """For tokens [start, start + length): which document each belongs to, numbered from 0
        at `start` (int32). Read from the shards' document indexes, only the entries inside the
        range; a shard boundary is a document boundary (shards hold whole documents)."""
        starts = np.zeros(length, dtype=np.int32)
        for shard, offset, take, done in self._pieces(start, length):
            offsets = self.document_offsets(shard)
            # the document starts inside (offset, offset + take)
            lo, hi = np.searchsorted(offsets, [offset + 1, offset + take])
            starts[done + offsets[lo:hi].astype(np.int64) - offset] = 1
            if done:
                starts[done] = 1  # the next shard starts a document
        return np.cumsum(starts, dtype=np.int32)
