"""Shard checksums: recorded when a save completes, verified before a load reads a byte.

DCP notices a shard that is missing, truncated or not a pickle at all, but a shard whose
bytes changed inside its tensor data (a flipped bit on disk, a bad copy) deserializes fine
and trains on silently. So every shard file gets a CRC-32 (`file_crc32`, shared with the
prepared datasets' shards: zlib's, read in 1 MiB blocks, far faster than the load itself):

- at save time each rank checksums the files it just wrote, inside its own DCP writer
  (`ChecksummingWriter.write_data`: the writer thread or process of an async save, never
  the training step), and leaves them in a small sidecar `__<rank>_crc32.json`;
- rank 0 merges the sidecars into `commit.json` when it commits (DCP has finished, so
  every rank's sidecar is on disk), and the sidecars go with the housekeeping;
- at load time the files are split across the ranks, each verifies its share, and the
  first mismatch reaches every rank as the same one line naming the file.

Checkpoints without checksums (older ones, other DCP writers) load unchecked.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from titanlite.data.checksums import file_crc32
from titanlite.parallel.collectives import raise_first

SIDECAR_SUFFIX = "crc32.json"


class ChecksummingWriter(FileSystemWriter):
    """DCP's file-system writer that checksums each file it wrote into a sidecar, then waits
    `delay_s` seconds before reporting them written (a test's save held in flight:
    async_save.py's `SLOW_WRITE_ENV`). Module level so the async process executor can pickle it."""

    def __init__(self, path: str | os.PathLike, delay_s: float = 0.0):
        super().__init__(path)
        self.delay_s = delay_s

    def write_data(self, plan, planner):  # type: ignore[override]
        future = super().write_data(plan, planner)
        files = sorted({result.storage_data.relative_path for result in future.wait()})  # a torch Future, already done
        folder = Path(self.path)
        sums = {name: file_crc32(folder / name) for name in files}
        (folder / f"{plan.storage_data.prefix}{SIDECAR_SUFFIX}").write_text(json.dumps(sums, sort_keys=True))
        time.sleep(self.delay_s)
        return future


def sidecars(folder: str | os.PathLike) -> list[Path]:
    return sorted(Path(folder).glob(f"__*_{SIDECAR_SUFFIX}"))


def collect(folder: str | os.PathLike) -> dict[str, str]:
    """Every rank's checksums of one finished save: shard file name -> CRC-32 hex."""
    return {name: crc for sidecar in sidecars(folder) for name, crc in json.loads(sidecar.read_text()).items()}


def _first_mismatch(folder: Path, names: list[str], sums: dict[str, str]) -> str | None:
    for name in names:
        path = folder / name
        try:
            actual = file_crc32(path)
        except OSError as error:
            return f"{path}: cannot read shard file ({error.strerror})"
        if actual != sums[name]:
            return f"{path}: shard file is corrupted (CRC-32 {actual}, recorded at save {sums[name]})"
    return None


def verify(folder: str | os.PathLike, sums: dict[str, str], group: dist.ProcessGroup | None) -> None:
    """Check every recorded shard's CRC-32, each rank of `group` a share of the files;
    collective when `group` spans several ranks. A mismatch raises on every rank."""
    if not sums:
        return
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    raise_first(group, _first_mismatch(Path(folder), sorted(sums)[rank::world], sums))


def tokenizer_record(tokenizer) -> dict[str, object]:
    """What a checkpoint records of the tokenizer it was trained with (`tokenizer` has
    .path and .vocab_size): a resume with another one would train on different token ids."""
    path = Path(tokenizer.path)
    return {
        "path": str(path),
        "vocab_size": int(tokenizer.vocab_size),
        "crc32": file_crc32(path) if path.is_file() else "",
    }
