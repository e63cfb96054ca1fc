"""The prepared-dataset format on disk (docs/data.md): token shards, their document
indexes and the manifest; written atomically, read by memory map.

    manifest.json         written last: format, version, dtype, counts, tokenizer, shards (each
                          with the CRC-32s of its two files, checksums.py)
    shard-00000.bin       the shard's token ids, little-endian uint16 (vocab <= 65,536) or uint32
    shard-00000.idx       little-endian uint64 offsets of its documents: documents + 1 entries,
                          0 first, the shard's token count last
    shard-00000.mask      chat data only (manifest "chat", data/chat.py): one byte a token, 1
                          where it is trained; and shard-00000.chat.json, its conversation counts

A shard is written as `<name>.bin.tmp-<pid>` and `<name>.idx.tmp-<pid>`, each flushed to
disk, then renamed: the .bin first, the .idx last. So a shard counts as complete exactly when its
.idx exists and agrees with its .bin's size; anything else is redone by a resumed
preparation. A folder without manifest.json is not (or not yet) a prepared dataset.

A shard's entry records a CRC-32 of its .bin and .idx, read back from the renamed files, so
a complete shard kept by a resumed preparation gets the same entry as a freshly written
one. Manifests written before checksums existed have entries without them: they load as
before (the format version is unchanged, so older titanlite reads new folders too) and
cannot be verified.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from titanlite.data.checksums import SHARD_FILES, shard_crc32
from titanlite.errors import TitanliteError

FORMAT = "titanlite-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_OFFSET = np.dtype("<u8")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int) -> str:
    """ "uint16" when every id fits, else "uint32" (a key of DTYPES)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _write_atomically(path: Path, data: bytes | np.ndarray) -> None:
    """Write `<path>.tmp-<pid>`, fsync it, rename it to `path`: the file appears complete or
    not at all. Test hook: TITANLITE_TEST_PREPARE_PAUSE_S makes a shard writer stop that long
    halfway through its tokens, so a test can kill a worker mid-shard."""
    raw = data if isinstance(data, bytes) else data.tobytes()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    pause = float(os.environ.get("TITANLITE_TEST_PREPARE_PAUSE_S", "0")) if path.suffix == ".bin" else 0.0
    with open(tmp, "wb") as f:
        if pause:
            f.write(raw[: len(raw) // 2])
            f.flush()
            time.sleep(pause)
            raw = raw[len(raw) // 2 :]
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardEntry(NamedTuple):
    """One shard as the manifest lists it; `crc32` is None in a manifest from before checksums."""

    name: str
    tokens: int
    documents: int
    crc32: dict[str, str] | None


def write_shard(
    folder: Path, index: int, documents: list[list[int]], dtype_name: str, chat: tuple[list, dict] | None = None
) -> dict[str, Any]:
    """Write one shard atomically (see the module docstring); returns its manifest entry. `chat`:
    the documents' loss masks and their counts (chat.py), written as the shard's .mask and
    .chat.json before its .idx."""
    name, dtype = shard_name(index), DTYPES[dtype_name]
    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    offsets = np.zeros(len(documents) + 1, dtype=_OFFSET)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter((t for d in documents for t in d), dtype=dtype, count=int(offsets[-1]))
    _write_atomically(folder / f"{name}.bin", tokens)
    if chat is not None:
        masks, counts = chat
        _write_atomically(folder / f"{name}.mask", np.fromiter((m for d in masks for m in d), np.uint8, len(tokens)))
        _write_atomically(folder / f"{name}.chat.json", json.dumps(counts).encode())
    _write_atomically(folder / f"{name}.idx", offsets)  # last: a shard with its .idx is complete
    return complete_shard(folder, index, dtype_name, chat is not None)


def complete_shard(folder: Path, index: int, dtype_name: str, chat: bool = False) -> dict[str, Any] | None:
    """The manifest entry of shard `index` if it was completely written, else None."""
    name, dtype = shard_name(index), DTYPES[dtype_name]
    idx, bin_ = folder / f"{name}.idx", folder / f"{name}.bin"
    try:
        offsets = np.fromfile(idx, dtype=_OFFSET)
        size = bin_.stat().st_size
        chat_entry = _chat_entry(folder, name, int(offsets[-1])) if chat and len(offsets) else {}
    except (OSError, ValueError):
        return None
    if len(offsets) == 0 or offsets[0] != 0 or int(offsets[-1]) * dtype.itemsize != size:
        return None
    suffixes = SHARD_FILES + (("mask",) if chat else ())
    entry = {"name": name, "tokens": int(offsets[-1]), "documents": len(offsets) - 1}
    return {**entry, **chat_entry, "crc32": shard_crc32(folder, name, suffixes)}


def _chat_entry(folder: Path, name: str, tokens: int) -> dict[str, int]:
    """A chat shard's counts, once its mask holds one byte a token (ValueError otherwise)."""
    if (folder / f"{name}.mask").stat().st_size != tokens:
        raise ValueError(f"{name}.mask is incomplete")
    return json.loads((folder / f"{name}.chat.json").read_text())


def remove_temporaries(folder: Path) -> None:
    """Partial files of an interrupted preparation (their writer is gone)."""
    for path in folder.glob("shard-*.tmp-*"):
        path.unlink(missing_ok=True)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Atomically: manifest.json appears complete or not at all."""
    _write_atomically(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def read_manifest(folder: Path, field: str) -> dict[str, Any]:
    """The checked manifest of a prepared folder; one line naming what is wrong otherwise."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise TitanliteError(f"{field}: {folder} is not a prepared dataset (not a folder)")
    if not path.is_file():
        raise TitanliteError(
            f"{field}: {folder} is not a prepared dataset (no {MANIFEST}; write one with "
            f"python -m titanlite.data.prepare SOURCE {folder} --tokenizer PATH)"
        )
    try:
        manifest = json.loads(path.read_text())
        version, shards, dtype = manifest["format_version"], manifest["shards"], DTYPES.get(manifest["dtype"])
        tokenizer = manifest["tokenizer"]
        entries = [
            ShardEntry(str(s["name"]), int(s["tokens"]), int(s["documents"]), _recorded_crc32(s)) for s in shards
        ]
        checks = (int(tokenizer["vocab_size"]), str(tokenizer["sha256"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TitanliteError(f"{field}: {path} is not a titanlite manifest ({type(e).__name__}: {e})") from None
    if manifest.get("format") != FORMAT:
        raise TitanliteError(f"{field}: {path} is not a titanlite manifest (format {manifest.get('format')!r})")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise TitanliteError(
            f"{field}: {path} has format version {version}; this titanlite reads version "
            f"{FORMAT_VERSION} and older (prepared by a newer titanlite?)"
        )
    if dtype is None or not checks[0] > 0:
        raise TitanliteError(f"{field}: {path}: unsupported dtype {manifest['dtype']!r} or vocab size {checks[0]}")
    manifest["_entries"] = entries
    return manifest


def _recorded_crc32(entry: dict[str, Any]) -> dict[str, str] | None:
    """A manifest entry's {"bin": CRC-32, "idx": CRC-32}; None when it has none (older manifests)."""
    if "crc32" not in entry:
        return None
    recorded = entry["crc32"]
    if not all(isinstance(recorded[suffix], str) for suffix in SHARD_FILES):  # KeyError, TypeError: not a manifest
        raise ValueError(f"shard {entry['name']}: crc32 {recorded!r} is not two hex strings")
    return {suffix: str(value) for suffix, value in recorded.items()}  # "mask" too, for chat data
