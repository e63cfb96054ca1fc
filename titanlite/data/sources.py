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
# A text file is refused once it holds MIN_TEXT_CHARS characters of which over MAX_BAD_FRACTION
# (and at least 8) are not valid UTF-8 (U+FFFD), and at its end by the same measure.
MIN_TEXT_CHARS = 4096
MAX_BAD_FRACTION = 0.01


class Source:
    """A corpus of text documents. Subclasses implement `_documents` (empty ones may be
    yielded: `one_pass` leaves them out) and set `empty_message`."""

    name: str  # "builtin", "files:<path>", "hf:<name>": recorded in the prepared manifest
    empty_message: str  # the error when no document is found

    def one_pass(self) -> Iterator[str]:
        """Every non-empty document once, in order (what preparation tokenizes)."""
        empty = True
        for text in filter(None, self._documents()):
            empty = False
            yield text
        if empty:
            raise TitanliteError(self.empty_message)

    def _documents(self) -> Iterator[str | None]:
        raise NotImplementedError


class LocalSource(Source):
    """Texts held in memory (`texts`), then `files` under `root`: a source the first-use
    cache (cache.py) can size and key by content."""

    texts: list[str] = []  # never mutated: BuiltinSource sets its own
    root: Path
    files: list[Path]

    def content_digest(self) -> str:
        """SHA-256 of everything this source reads (each text with its length, then each file's
        path relative to `root`, bytes and byte count): the cache key of its prepared form,
        which changes with the files, or when another Python ships other text."""
        digest = hashlib.sha256()
        for text in self.texts:
            raw = text.encode()
            digest.update(len(raw).to_bytes(8, "little") + raw)
        for path in self.files:
            digest.update(str(path.relative_to(self.root)).encode() + b"\0")
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
                digest.update(f.tell().to_bytes(8, "little"))  # the bytes read
        return digest.hexdigest()

    def size_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.texts) + sum(f.stat().st_size for f in self.files)


# --------------------------------------------------------------------------- builtin


class BuiltinSource(LocalSource):
    """Real text that ships with Python: every `pydoc_data.topics` entry (sorted by topic),
    then every standard-library `.py` file (sorted walk, skipping site-packages and the
    test/tests/idlelib/lib2to3 folders), one document each. Files that are not valid
    UTF-8 are skipped. Deterministic for a given Python installation (another Python
    version ships other text). Stdlib files are small, so each is read whole."""

    name = "builtin"
    digest: str | None = None  # content_digest's, shared by every instance
    empty_message = "training.dataset: the builtin corpus is empty (no pydoc topics or stdlib sources found)"

    def __init__(self) -> None:
        from pydoc_data.topics import topics

        self.texts = [topics[k] for k in sorted(topics)]
        self.root = Path(sysconfig.get_paths()["stdlib"])
        self.files = []
        for folder, dirs, files in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if d not in BUILTIN_SKIP_DIRS)
            self.files.extend(Path(folder) / f for f in sorted(files) if f.endswith(".py"))

    def content_digest(self) -> str:
        """LocalSource's, computed once per process: the standard library does not change while a
        process runs, and hashing all of it took ~70 ms of CPU at every trainer start (each case
        of a test session starts one)."""
        BuiltinSource.digest = BuiltinSource.digest or super().content_digest()
        return BuiltinSource.digest

    def _documents(self) -> Iterator[str]:
        yield from self.texts
        for path in self.files:
            try:
                yield path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue


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


class FilesSource(LocalSource):
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
        self.name = f"files:{path}"
        self.files = list_data_files(path)
        self.root = Path(path) if Path(path).is_dir() else Path(path).parent
        self.empty_message = (
            f"training.dataset_path: no documents in {path} (all {len(self.files)} data files are empty)"
        )
        if any(f.suffix == ".parquet" for f in self.files):
            _import_pyarrow(self.files)

    def _documents(self) -> Iterator[str | None]:
        for f in self.files:
            yield from {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}[f.suffix](f)


def _lines(path: Path) -> Iterator[tuple[str, int]]:
    """Decoded lines, each with its line number.

    A file that is not text is refused rather than trained on: a NUL byte anywhere, or more
    than 1% of its characters undecodable (U+FFFD) once a few KB were read. Both checks
    run on bytes and strings the reader holds anyway (no second pass)."""
    chars = bad = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if b"\0" in raw:
                raise TitanliteError(f"training.dataset_path: {path} is not text (a NUL byte on line {number})")
            text = raw.decode("utf-8", errors="replace")
            chars, bad = chars + len(text), bad + text.count("\ufffd")
            if chars >= MIN_TEXT_CHARS:
                _check_utf8(path, chars, bad)
            yield text, number
    _check_utf8(path, chars, bad)


def _check_utf8(path: Path, chars: int, bad: int) -> None:
    if bad > MAX_BAD_FRACTION * max(chars, 1) and bad >= 8:
        raise TitanliteError(
            f"training.dataset_path: {path} is not UTF-8 text ({bad:,} of its first {chars:,} "
            "characters are not valid UTF-8)"
        )


def _read_txt(path: Path) -> Iterator[str]:
    """Paragraphs; an empty one (between two blank lines) is left out by `one_pass`."""
    parts: list[str] = []
    size = 0
    for text, _ in _lines(path):
        blank = not text.strip()
        if not blank:
            parts.append(text)
            size += len(text)
        if blank or size >= MAX_PARAGRAPH_CHARS:
            yield "".join(parts).rstrip("\r\n")
            parts, size = [], 0
    yield "".join(parts).rstrip("\r\n")


def jsonl_records(path: Path) -> Iterator[tuple[Any, str]]:
    """Each non-blank line's JSON value, with where it is (`file:line`, for errors)."""
    for raw, number in _lines(path):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield json.loads(raw), where
        except json.JSONDecodeError as e:
            raise TitanliteError(f"training.dataset_path: {where}: not valid JSON ({e.msg})") from None


def _read_jsonl(path: Path) -> Iterator[str]:
    for record, where in jsonl_records(path):
        if not isinstance(record, dict) or "text" not in record:
            raise TitanliteError(f'training.dataset_path: {where}: line has no "text" field')
        text = record["text"]
        if not isinstance(text, str):
            raise TitanliteError(f'training.dataset_path: {where}: "text" is {type(text).__name__}, expected a string')
        yield text


def _import_pyarrow(files: list[Path]) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        first = next(f for f in files if f.suffix == ".parquet")
        raise TitanliteError(f"training.dataset_path: reading {first} needs pyarrow (pip install pyarrow)") from None
    return pq


def _read_parquet(path: Path) -> Iterator[str | None]:
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
    if str(kind) not in ("string", "large_string", "string_view"):  # utf8 and large_utf8 print as these
        raise TitanliteError(f'training.dataset_path: {path}: column "text" is {kind}, expected strings')
    for group in range(pf.num_row_groups):
        yield from pf.read_row_group(group, columns=["text"]).column(0).to_pylist()  # null rows: None


def build_source(dataset: str, dataset_path: str = "") -> Source:
    """The source named by a validated `training.dataset`: "builtin" or "files" (a Hugging
    Face dataset is read by the prepare command only: hf_source.py)."""
    return BuiltinSource() if dataset == "builtin" else FilesSource(dataset_path)
