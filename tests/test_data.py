"""Document sources, packing into windows, dp sharding and exact resume."""

from __future__ import annotations

import itertools
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titanlite.data import Tokenizer, TokenWindowLoader, build_dataloader
from titanlite.data import sources as sources_module
from titanlite.data.sources import BuiltinSource, FilesSource, HFSource, build_source, start_cursor
from titanlite.errors import TitanliteError

SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "titanlite.model"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(SHIPPED))


def cfg(**kw) -> SimpleNamespace:
    base = dict(dataset="builtin", dataset_path="", seq_len=32, local_batch_size=4)
    return SimpleNamespace(**{**base, **kw})


def take(source, n, cursor=None):
    return list(itertools.islice(source.documents(cursor), n))


def batches(loader, n):
    return [next(loader) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, list[str]]:
    """A folder of .txt and .jsonl files (one nested) and its documents in stream order."""
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("First paragraph,\nstill first.\n\n\nSecond paragraph.\n\nThird ✓\n")
    (root / "b.jsonl").write_text(
        json.dumps({"text": "json one", "id": 1}) + "\n\n" + json.dumps({"text": "json two: 日本語"}) + "\n" + json.dumps({"text": ""}) + "\n"
    )
    (root / "sub" / "c.txt").write_text("nested file\nwith two lines")
    (root / "notes.md").write_text("ignored")
    (root / ".hidden.txt").write_text("ignored too")
    docs = ["First paragraph,\nstill first.", "Second paragraph.", "Third ✓", "json one", "json two: 日本語", "nested file\nwith two lines"]
    return root, docs


# --------------------------------------------------------------------------- sources


def test_files_source_documents_in_order(corpus):
    root, docs = corpus
    source = FilesSource(str(root))
    assert [f.name for f in source.files] == ["a.txt", "b.jsonl", "c.txt"]
    got = take(source, 2 * len(docs) + 1)
    assert [t for t, _ in got] == docs + docs + docs[:1]
    assert [c["epoch"] for _, c in got] == [0] * len(docs) + [1] * len(docs) + [2]


def test_files_source_resumes_from_every_cursor(corpus):
    root, docs = corpus
    source = FilesSource(str(root))
    stream = take(source, 3 * len(docs))
    for k, (_, cursor) in enumerate(stream[:-4]):
        resumed = [t for t, _ in take(FilesSource(str(root)), 3, cursor)]
        assert resumed == [t for t, _ in stream[k + 1 : k + 4]]
        assert take(source, 1, cursor)[0][1] == stream[k + 1][1]  # same cursors too


def test_single_file_and_long_paragraph(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "MAX_PARAGRAPH_CHARS", 12)
    path = tmp_path / "one.txt"
    path.write_text("aaaa\nbbbb\ncccc\ndddd\n\nshort\n")
    source = build_source("files", str(path))
    got = take(source, 4)
    assert [t for t, _ in got] == ["aaaa\nbbbb\ncccc", "dddd", "short", "aaaa\nbbbb\ncccc"]
    assert [t for t, _ in take(source, 2, got[0][1])] == ["dddd", "short"]


def test_wrap_around_with_two_tiny_docs(tmp_path, tok):
    path = tmp_path / "tiny.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n')
    source = FilesSource(str(path))
    assert [(t, c["epoch"]) for t, c in take(source, 5)] == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2)]
    # the loader keeps going across many epochs, each doc packed as bos .. eos
    loader = TokenWindowLoader(source, tok, seq_len=7, local_batch_size=2, dp_rank=0, dp_degree=1)
    x, y = batches(loader, 10)[-1]
    assert x.shape == (2, 7) and loader.state_dict()["cursor"]["epoch"] > 1
    doc = tok.encode("a") + tok.encode("b")
    stream = doc * (len(doc) * 20)
    assert x[0].tolist() == stream[9 * 16 : 9 * 16 + 7]


def test_builtin_source_is_deterministic_and_resumable():
    a, b = BuiltinSource(), BuiltinSource()
    first = take(a, 100)
    assert [t for t, _ in first] == [t for t, _ in take(b, 100)]
    from pydoc_data.topics import topics

    assert first[0][0] == topics[sorted(topics)[0]]
    assert len(a) > 100 and all(text for text, _ in first)
    assert any("def " in t for t, _ in first)  # reached the stdlib sources
    assert [t for t, _ in take(b, 3, first[49][1])] == [t for t, _ in first[50:53]]


def test_builtin_source_wraps(monkeypatch):
    source = BuiltinSource()
    source._files = source._files[:2]
    n = len(source)
    got = take(source, n + 2)
    assert [t for t, _ in got[n:]] == [t for t, _ in got[:2]]
    assert got[n][1]["epoch"] == 1


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
        build_dataloader(cfg(dataset="files", dataset_path=str(path)), None, 0, 1)
    assert "\n" not in str(info.value)


def test_all_files_empty(tmp_path, tok):
    (tmp_path / "a.txt").write_text("\n\n   \n")
    (tmp_path / "b.jsonl").write_text('{"text": ""}\n')
    loader = build_dataloader(cfg(dataset="files", dataset_path=str(tmp_path)), tok, 0, 1)
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: no documents"):
        next(loader)


def test_jsonl_without_text_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"content": "no text"}\n')
    with pytest.raises(TitanliteError, match=r"training\.dataset_path: .*bad\.jsonl:3: .*\"text\""):
        take(FilesSource(str(path)), 2)


@pytest.mark.parametrize("line,why", [("not json", "not valid JSON"), ('{"text": 5}', "expected a string"), ("[1, 2]", '"text"')])
def test_jsonl_bad_lines(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TitanliteError, match=rf"bad\.jsonl:1: .*{why}"):
        take(FilesSource(str(path)), 1)


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i}" for i in range(7)]
    texts[3] = None
    pq.write_table(pa.table({"text": texts, "n": list(range(7))}), tmp_path / "d.parquet", row_group_size=3)
    source = FilesSource(str(tmp_path))
    got = take(source, 7)
    want = [t for t in texts if t]
    assert [t for t, _ in got] == want + want[:1]
    assert [t for t, _ in take(source, 3, got[1][1])] == want[2:5]  # resumes mid row group, skips the null
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "e.parquet")
    with pytest.raises(TitanliteError, match=r"e\.parquet: no \"text\" column"):
        take(FilesSource(str(tmp_path / "e.parquet")), 1)


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*d\.parquet needs pyarrow"):
        FilesSource(str(tmp_path))


def test_hf_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(TitanliteError, match=r"pip install titanlite\[hf\]"):
        build_source("hf", "allenai/c4")


def test_hf_local_jsonl(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    source = HFSource(str(path))
    got = take(source, 7)
    assert [t for t, _ in got] == [f"doc {i}" for i in range(5)] + ["doc 0", "doc 1"]
    assert [t for t, _ in take(source, 2, got[2][1])] == ["doc 3", "doc 4"]
    assert got[5][1]["epoch"] == 1


# --------------------------------------------------------------------------- loader


def test_windows_are_consecutive_and_labels_shifted(tmp_path, tok):
    docs = [f"document number {i}: " + "words " * (i % 7) for i in range(40)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    seq, B = 9, 3
    loader = build_dataloader(cfg(dataset="files", dataset_path=str(path), seq_len=seq, local_batch_size=B), tok, 0, 1)
    stream = [i for d in docs for i in tok.encode(d)] * 3
    for step in range(12):
        x, y = next(loader)
        assert x.shape == y.shape == (B, seq) and x.dtype == y.dtype == torch.long
        for b in range(B):
            w = (step * B + b) * (seq + 1)
            assert x[b].tolist() == stream[w : w + seq]
            assert y[b].tolist() == stream[w + 1 : w + seq + 1]
    assert loader.windows == 12 * B


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_shards_partition_the_global_microbatch(tok, dp):
    B = 2
    reference = TokenWindowLoader(BuiltinSource(), tok, 16, B * dp, 0, 1)
    ranks = [TokenWindowLoader(BuiltinSource(), tok, 16, B, r, dp) for r in range(dp)]
    for _ in range(6):
        want_x, want_y = next(reference)
        got = [next(r) for r in ranks]
        assert all(x.shape == (B, 16) for x, _ in got)
        assert torch.equal(torch.cat([x for x, _ in got]), want_x)
        assert torch.equal(torch.cat([y for _, y in got]), want_y)
    states = [r.state_dict() for r in ranks]
    assert all(s == reference.state_dict() for s in states)


def test_tp_ranks_of_one_dp_rank_are_identical(tok):
    a = TokenWindowLoader(BuiltinSource(), tok, 16, 2, 1, 2)
    b = TokenWindowLoader(BuiltinSource(), tok, 16, 2, 1, 2)
    assert_same(batches(a, 4), batches(b, 4))


def test_exact_resume_builtin(tok):
    loader = build_dataloader(cfg(seq_len=64, local_batch_size=4), tok, 0, 1)
    batches(loader, 7)
    state = loader.state_dict()
    after = batches(loader, 5)
    fresh = build_dataloader(cfg(seq_len=64, local_batch_size=4), tok, 0, 1)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert_same(batches(fresh, 5), after)
    assert fresh.state_dict() == loader.state_dict()


def test_exact_resume_files_across_epochs(corpus, tok):
    root, _ = corpus
    make = lambda: build_dataloader(cfg(dataset="files", dataset_path=str(root), seq_len=5, local_batch_size=2), tok, 0, 1)
    loader = make()
    for n in range(1, 30, 4):
        state = loader.state_dict()
        after = batches(loader, n)
        fresh = make()
        fresh.load_state_dict(state)
        assert_same(batches(fresh, n), after)
    assert loader.state_dict()["cursor"]["epoch"] >= 1


@pytest.mark.parametrize("save_dp,load_dp", [(2, 4), (2, 1), (4, 2), (1, 4)])
def test_resume_at_another_dp_degree(tok, save_dp, load_dp):
    global_batch, seq = 8, 16
    reference = TokenWindowLoader(BuiltinSource(), tok, seq, global_batch, 0, 1)
    saved = [TokenWindowLoader(BuiltinSource(), tok, seq, global_batch // save_dp, r, save_dp) for r in range(save_dp)]
    for _ in range(7):
        next(reference)
        for r in saved:
            next(r)
    state = saved[-1].state_dict()
    assert state == saved[0].state_dict() == reference.state_dict()
    resumed = [TokenWindowLoader(BuiltinSource(), tok, seq, global_batch // load_dp, r, load_dp) for r in range(load_dp)]
    for r in resumed:
        r.load_state_dict(state)
    for _ in range(5):
        want_x, want_y = next(reference)
        got = [next(r) for r in resumed]
        assert torch.equal(torch.cat([x for x, _ in got]), want_x)
        assert torch.equal(torch.cat([y for _, y in got]), want_y)


def test_state_is_small_and_plain(tok):
    loader = TokenWindowLoader(BuiltinSource(), tok, 256, 8, 0, 1)
    batches(loader, 3)
    state = loader.state_dict()
    assert set(state) == {"source", "windows", "cursor", "skip_tokens"}
    assert set(state["cursor"]) == {"epoch", "item", "line", "offset"}
    assert state["windows"] == 24 and state["source"] == "builtin"
    assert len(repr(state)) < 200


def test_state_round_trips_through_dcp(tmp_path, corpus, tok):
    import warnings

    import torch.distributed.checkpoint as dcp

    root, _ = corpus
    make = lambda: build_dataloader(cfg(dataset="files", dataset_path=str(root), seq_len=6, local_batch_size=2), tok, 0, 1)
    loader = make()
    batches(loader, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: single process" notices
        dcp.save({"dataloader": loader.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
        fresh = make()
        template = {"dataloader": fresh.state_dict()}
        dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_state_dict(template["dataloader"])
    assert_same(batches(fresh, 4), batches(loader, 4))


def test_state_of_another_source_kind_starts_over(corpus, tok, caplog):
    root, _ = corpus
    files = build_dataloader(cfg(dataset="files", dataset_path=str(root), seq_len=6, local_batch_size=2), tok, 0, 1)
    batches(files, 3)
    builtin = build_dataloader(cfg(seq_len=6, local_batch_size=2), tok, 0, 1)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        builtin.load_state_dict(files.state_dict())
    assert "starting it from its beginning" in caplog.text
    assert builtin.windows == 6
    assert_same(batches(builtin, 2), batches(build_dataloader(cfg(seq_len=6, local_batch_size=2), tok, 0, 1), 2))


def test_bad_dp_rank(tok):
    with pytest.raises(ValueError):
        TokenWindowLoader(BuiltinSource(), tok, 8, 2, 2, 2)


def test_start_cursor_is_plain_ints():
    assert start_cursor() == {"epoch": 0, "item": 0, "line": 0, "offset": 0}
