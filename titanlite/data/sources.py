"""Document sources: the text a preparation tokenizes, read once, in order.

`one_pass()` yields every document of a source exactly once, in an order fixed by the
source alone (so a resumed preparation cuts the same shards), reading one file or row group
at a time, never a whole corpus. A source with no document raises `TitanliteError`
instead of yielding nothing. Sources: the built-in corpus, local .txt/.jsonl/.parquet files,
and (hf_source.py) a Hugging Face dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from titanlite.errors import TitanliteError, one_line

# Text files: one document per blank-line-separated paragraph; a paragraph longer than
# this many characters is cut at a line boundary and continues as the next document, so
# a file without blank lines never has to fit in memory at once.
MAX_PARAGRAPH_CHARS = 1 << 20

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
BUILTIN_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


class Source:
    """A corpus of text documents. Subclasses implement `_documents`."""

    name: str  # "builtin", "files:<path>", "hf:<name>": recorded in the prepared manifest

    def one_pass(self) -> Iterator[str]:
        """Every non-empty document once, in order (what preparation tokenizes)."""
        empty = True
        for text in self._documents():
            if text:
                empty = False
                yield text
        if empty:
            raise TitanliteError(self._empty_message())

    def _documents(self) -> Iterator[str]:
        raise NotImplementedError

    def _empty_message(self) -> str:
        return f"training.dataset_path: no documents in {self.name}"


# --------------------------------------------------------------------------- builtin


def stdlib_files() -> list[Path]:
    """The standard library's .py files, in a fixed order (sorted walk, tests and
    third-party packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in BUILTIN_SKIP_DIRS)
        found.extend(Path(folder) / f for f in sorted(files) if f.endswith(".py"))
    return found


class BuiltinSource(Source):
    """Real text that ships with Python: every `pydoc_data.topics` entry (sorted by topic),
    then every standard-library `.py` file (sorted walk, skipping site-packages and the
    test/tests/idlelib/lib2to3 folders), one document each. Files that are not valid
    UTF-8 are skipped. Deterministic for a given Python installation (another Python
    version ships other text). Stdlib files are small, so each is read whole."""

    name = "builtin"

    def __init__(self) -> None:
        from pydoc_data.topics import topics

        self._topics = [topics[k] for k in sorted(topics)]
        self._files = stdlib_files()

    def _documents(self) -> Iterator[str]:
        yield from self._topics
        for path in self._files:
            try:
                yield path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    def content_digest(self) -> str:
        """SHA-256 of everything this source reads: the cache key of its prepared form,
        which changes when another Python ships other text."""
        digest = hashlib.sha256()
        for text in self._topics:
            raw = text.encode()
            digest.update(len(raw).to_bytes(8, "little") + raw)
        root = Path(sysconfig.get_paths()["stdlib"])
        for path in self._files:
            _hash_file(digest, str(path.relative_to(root)), path)
        return digest.hexdigest()

    def size_bytes(self) -> int:
        return sum(len(t.encode()) for t in self._topics) + sum(f.stat().st_size for f in self._files)

    def _empty_message(self) -> str:
        return "training.dataset: the builtin corpus is empty (no pydoc topics or stdlib sources found)"


# --------------------------------------------------------------------------- files


def list_data_files(path: str) -> list[Path]:
    """The .txt/.jsonl/.parquet files at `path` (a file, or a folder searched recursively,
    sorted by relative path, hidden entries skipped)."""
    p = Path(path)
    if not p.exists():
        raise TitanliteError(f"training.dataset_path: not found: {path}")
    if p.is_file():
        if p.suffix not in FILE_SUFFIXES:
            raise TitanliteError(
                f"training.dataset_path: unsupported file type {p.suffix or '(none)'}: {path} (expected "
                f"{'/'.join(FILE_SUFFIXES)})"
            )
        return [p]
    found = []
    for folder, dirs, files in os.walk(p):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(Path(folder) / f for f in files if Path(f).suffix in FILE_SUFFIXES and not f.startswith("."))
    if not found:
        raise TitanliteError(f"training.dataset_path: no {'/'.join(FILE_SUFFIXES)} files in {path}")
    return sorted(found, key=lambda f: f.relative_to(p).parts)


class FilesSource(Source):
    """Local files, in sorted order, read line by line (row group by row group for parquet):

    - `.txt`: one document per paragraph (lines up to a blank line; like `datasets`'
      text builder with `sample_by="paragraph"`); a paragraph over 1 MiB of text is cut at
      a line boundary. Lines keep their newlines; the paragraph's last newline is dropped.
    - `.jsonl`: one document per line, its "text" field (blank lines skipped).
    - `.parquet`: one document per row of the "text" column (needs pyarrow); null rows skipped.

    A few bytes that are not valid UTF-8 are replaced (U+FFFD); a file that is not text
    at all (NUL bytes, or over 1% undecodable) is refused, naming the file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = f"files:{path}"
        self.files = list_data_files(path)
        if any(f.suffix == ".parquet" for f in self.files):
            _import_pyarrow(self.files)

    def content_digest(self) -> str:
        """SHA-256 over the files' relative paths and bytes."""
        digest = hashlib.sha256()
        root = Path(self.path) if Path(self.path).is_dir() else Path(self.path).parent
        for f in self.files:
            _hash_file(digest, str(f.relative_to(root)), f)
        return digest.hexdigest()

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def _documents(self) -> Iterator[str]:
        for f in self.files:
            yield from {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}[f.suffix](f)

    def _empty_message(self) -> str:
        return f"training.dataset_path: no documents in {self.path} (all {len(self.files)} data files are empty)"


def _hash_file(digest: Any, name: str, path: Path) -> None:
    """Feed `name`, the bytes of `path` and their count into `digest`."""
    digest.update(name.encode() + b"\0")
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    digest.update(size.to_bytes(8, "little"))


def _lines(path: Path) -> Iterator[tuple[str, int]]:
    """Decoded lines, each with its line number.

    A file that is not text is refused rather than trained on: a NUL byte anywhere, or more
    than 1% of its characters undecodable (U+FFFD) once a few KB were read. Both checks
    run on bytes and strings the reader holds anyway (no second pass)."""
    check = _TextCheck(path)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            text = raw.decode("utf-8", errors="replace")
            check.add(raw, text, number)
            yield text, number
    check.finish()


class _TextCheck:
    """Counts of what a text file should not hold; raises on the first sign it is binary."""

    MIN_CHARS = 4096
    MAX_BAD_FRACTION = 0.01

    def __init__(self, path: Path) -> None:
        self.path, self.chars, self.bad = path, 0, 0

    def add(self, raw: bytes, text: str, line: int) -> None:
        if b"\0" in raw:
            raise TitanliteError(f"training.dataset_path: {self.path} is not text (a NUL byte on line {line})")
        self.chars += len(text)
        self.bad += text.count("\ufffd")
        if self.chars >= self.MIN_CHARS:
            self.finish()

    def finish(self) -> None:
        if self.bad > self.MAX_BAD_FRACTION * max(self.chars, 1) and self.bad >= 8:
            raise TitanliteError(
                f"training.dataset_path: {self.path} is not UTF-8 text ({self.bad:,} of its first {self.chars:,} "
                "characters are not valid UTF-8)"
            )


def _read_txt(path: Path) -> Iterator[str]:
    parts: list[str] = []
    size = 0
    for text, _ in _lines(path):
        blank = not text.strip()
        if not blank:
            parts.append(text)
            size += len(text)
        if parts and (blank or size >= MAX_PARAGRAPH_CHARS):
            yield "".join(parts).rstrip("\r\n")
            parts, size = [], 0
    if parts:
        yield "".join(parts).rstrip("\r\n")


def _read_jsonl(path: Path) -> Iterator[str]:
    for raw, number in _lines(path):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TitanliteError(f"training.dataset_path: {where}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or "text" not in record:
            raise TitanliteError(f'training.dataset_path: {where}: line has no "text" field')
        text = record["text"]
        if not isinstance(text, str):
            raise TitanliteError(f'training.dataset_path: {where}: "text" is {type(text).__name__}, expected a string')
        if text:
            yield text


def _import_pyarrow(files: list[Path]) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        first = next(f for f in files if f.suffix == ".parquet")
        raise TitanliteError(f"training.dataset_path: reading {first} needs pyarrow (pip install pyarrow)") from None
    return pq


def _read_parquet(path: Path) -> Iterator[str]:
    import pyarrow as pa

    pq = _import_pyarrow([path])
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise TitanliteError(f"training.dataset_path: {path}: not a readable parquet file ({one_line(e)})") from None
    schema = pf.schema_arrow
    if "text" not in schema.names:
        raise TitanliteError(f'training.dataset_path: {path}: no "text" column (columns: {", ".join(schema.names)})')
    kind = schema.field("text").type
    if not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or getattr(pa.types, "is_string_view", lambda _: False)(kind)
    ):
        raise TitanliteError(f'training.dataset_path: {path}: column "text" is {kind}, expected strings')
    for group in range(pf.num_row_groups):
        yield from (text for text in pf.read_row_group(group, columns=["text"]).column(0).to_pylist() if text)


def build_source(dataset: str, dataset_path: str = "") -> Source:
    """The source named by a validated `training.dataset`: "builtin" or "files" (a Hugging
    Face dataset is read by the prepare command only: hf_source.py)."""
    if dataset == "builtin":
        return BuiltinSource()
    return FilesSource(dataset_path)
