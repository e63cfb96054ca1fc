"""titanlite/data/sources.py, the document sources: order, file kinds, one-line errors, text checks.
(Hugging Face datasets: test_hf_source.py; preparation: test_prepare.py; the loader: test_loader.py.)"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from titanlite.data import sources as sources_module
from titanlite.data.sources import BuiltinSource, FilesSource, LocalSource, build_source
from titanlite.errors import TitanliteError


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, list[str]]:
    """A folder of .txt and .jsonl files (one nested) and its documents in stream order."""
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("First paragraph,\nstill first.\n\n\nSecond paragraph.\n\nThird ✓\n")
    (root / "b.jsonl").write_text(
        json.dumps({"text": "json one", "id": 1})
        + "\n\n"
        + json.dumps({"text": "json two: 日本語"})
        + "\n"
        + json.dumps({"text": ""})
        + "\n"
    )
    (root / "sub" / "c.txt").write_text("nested file\nwith two lines")
    (root / "notes.md").write_text("ignored")
    (root / ".hidden.txt").write_text("ignored too")
    docs = [
        "First paragraph,\nstill first.",
        "Second paragraph.",
        "Third ✓",
        "json one",
        "json two: 日本語",
        "nested file\nwith two lines",
    ]
    return root, docs


# --------------------------------------------------------------------------- sources


def test_files_source_documents_in_order(corpus):
    root, docs = corpus
    source = FilesSource(str(root))
    assert [f.name for f in source.files] == ["a.txt", "b.jsonl", "c.txt"]
    assert list(source.one_pass()) == docs
    assert list(FilesSource(str(root)).one_pass()) == docs  # the same order every time


def test_single_file_and_long_paragraph(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "MAX_PARAGRAPH_CHARS", 12)
    path = tmp_path / "one.txt"
    path.write_text("aaaa\nbbbb\ncccc\ndddd\n\nshort\n")
    assert list(build_source("files", str(path)).one_pass()) == ["aaaa\nbbbb\ncccc", "dddd", "short"]


def test_builtin_source_is_deterministic():
    first = list(itertools.islice(BuiltinSource().one_pass(), 100))
    assert first == list(itertools.islice(BuiltinSource().one_pass(), 100))
    from pydoc_data.topics import topics

    assert first[0] == topics[sorted(topics)[0]] and all(first)
    assert any("def " in t for t in first)  # reached the stdlib sources


@pytest.mark.parametrize("make", ["missing", "empty_dir", "no_matching", "bad_suffix"])
def test_dataset_path_errors(tmp_path, make):
    if make == "missing":
        path = tmp_path / "nope"
    elif make == "empty_dir":
        path = tmp_path / "empty"
        path.mkdir()
    elif make == "no_matching":
        path = tmp_path / "other"
        path.mkdir()
        (path / "x.csv").write_text("text\nhello\n")
    else:
        path = tmp_path / "x.csv"
        path.write_text("hello")
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*" + path.name) as info:
        build_source("files", str(path))
    assert "\n" not in str(info.value)


def test_all_files_empty(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n   \n")
    (tmp_path / "b.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: no documents"):
        list(build_source("files", str(tmp_path)).one_pass())


def test_random_bytes_are_not_text(tmp_path):
    """Issue 9: a .txt of random bytes is refused, naming the file, never trained on."""
    import random

    path = tmp_path / "random.txt"
    path.write_bytes(random.Random(0).randbytes(20_000))
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*random\.txt is not (UTF-8 )?text") as info:
        list(build_source("files", str(path)).one_pass())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "content, why",
    [(b"text\x00with a NUL\n", "a NUL byte on line 1"), ("caf\xe9 ".encode("latin-1") * 2000, "not valid UTF-8")],
)
def test_binary_looking_text_is_refused(tmp_path, content, why):
    path = tmp_path / "odd.txt"
    path.write_bytes(content)
    with pytest.raises(TitanliteError, match=why):
        list(build_source("files", str(path)).one_pass())


def test_a_few_bad_bytes_are_tolerated(tmp_path):
    path = tmp_path / "mostly.txt"
    path.write_bytes(b"plain english text. " * 500 + b"one latin-1 caf\xe9\n")
    (text,) = list(build_source("files", str(path)).one_pass())
    assert text.endswith("caf\ufffd")


def test_content_digest_follows_the_bytes(corpus):
    root, _ = corpus
    before = FilesSource(str(root)).content_digest()
    assert FilesSource(str(root)).content_digest() == before
    (root / "a.txt").write_text("changed\n")
    assert FilesSource(str(root)).content_digest() != before
    assert len(BuiltinSource().content_digest()) == 64 and BuiltinSource().size_bytes() > 1_000_000
    assert BuiltinSource().content_digest() == LocalSource.content_digest(BuiltinSource())  # the memo is the hash


def test_jsonl_without_text_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"content": "no text"}\n')
    with pytest.raises(TitanliteError, match=r"training\.dataset_path: .*bad\.jsonl:3: .*\"text\""):
        list(FilesSource(str(path)).one_pass())


@pytest.mark.parametrize(
    "line,why", [("not json", "not valid JSON"), ('{"text": 5}', "expected a string"), ("[1, 2]", '"text"')]
)
def test_jsonl_bad_lines(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TitanliteError, match=rf"bad\.jsonl:1: .*{why}"):
        list(FilesSource(str(path)).one_pass())


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i}" for i in range(7)]
    texts[3] = None
    pq.write_table(pa.table({"text": texts, "n": list(range(7))}), tmp_path / "d.parquet", row_group_size=3)
    want = [t for t in texts if t]
    assert list(FilesSource(str(tmp_path)).one_pass()) == want  # row groups in order, the null skipped
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "e.parquet")
    with pytest.raises(TitanliteError, match=r"e\.parquet: no \"text\" column"):
        list(FilesSource(str(tmp_path / "e.parquet")).one_pass())


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*d\.parquet needs pyarrow"):
        FilesSource(str(tmp_path))
