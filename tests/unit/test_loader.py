"""The loader over prepared shards: shuffle is a permutation, blend weights hold, dp ranks
partition each global microbatch, state resumes exactly at any dp degree, the held-out
split is disjoint from training, a mismatched tokenizer is refused."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titanlite.config import parse_blend
from titanlite.data.blend import BlendPattern
from titanlite.data.corpus import build_dataloader, open_corpus
from titanlite.data.loader import TokenWindowLoader
from titanlite.data.shard_format import write_manifest, write_shard
from titanlite.data.shuffle import FeistelPermutation
from titanlite.data.token_shards import TokenShards
from titanlite.data.windows import DatasetWindows, WindowStream
from titanlite.errors import TitanliteError

VOCAB = 4096
SEQ = 15  # windows of 16 tokens
CPU = torch.device("cpu")


def make_prepared(folder: Path, tokens: int, first: int = 0, sha256: str = "0" * 64, shard_tokens: int = 700) -> TokenShards:
    """A prepared folder whose stream is `first, first+1, ...` (mod VOCAB): window w of it
    starts with a known id, so tests can tell windows apart by their first token."""
    folder.mkdir(parents=True)
    stream = [(first + i) % VOCAB for i in range(tokens)]
    entries = [write_shard(folder, k, [stream[a : a + shard_tokens]], "uint16") for k, a in enumerate(range(0, tokens, shard_tokens))]
    write_manifest(folder, {"format": "titanlite-tokens", "format_version": 1, "dtype": "uint16", "source": "test",
                            "tokens": tokens, "documents": len(entries), "shards": entries,
                            "tokenizer": {"file": "t", "kind": "sentencepiece", "sha256": sha256, "vocab_size": VOCAB}})
    return TokenShards(folder)


@pytest.fixture
def shards(tmp_path) -> TokenShards:
    return make_prepared(tmp_path / "a", 16 * 200 + 5)  # 200 windows and a tail


def stream_of(shards: TokenShards, seed: int | None = 7) -> WindowStream:
    return WindowStream([DatasetWindows(shards, SEQ + 1, 0, 200, seed)], [1.0], "test")


def loader(stream: WindowStream, batch: int, rank: int = 0, dp: int = 1, prefetch: bool = True) -> TokenWindowLoader:
    return TokenWindowLoader(stream, batch, rank, dp, prefetch=prefetch)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


# --------------------------------------------------------------------------- shuffle


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 64, 65, 1000, 4097])
def test_feistel_is_a_permutation(n):
    perm = FeistelPermutation(n, key=12345)
    assert sorted(perm(i) for i in range(n)) == list(range(n))


def test_feistel_depends_on_the_key_and_needs_no_table():
    a, b = FeistelPermutation(1000, 1), FeistelPermutation(1000, 2)
    order_a = [a(i) for i in range(1000)]
    assert order_a == [FeistelPermutation(1000, 1)(i) for i in range(1000)]  # deterministic
    assert order_a != [b(i) for i in range(1000)] and order_a != list(range(1000))
    huge = FeistelPermutation(10**10, 3)  # 10^10 windows: a few ints of state
    assert all(0 <= huge(i) < 10**10 for i in range(0, 10**10, 10**8))
    assert not any(isinstance(v, (list, np.ndarray)) and len(v) > 8 for v in vars(huge).values())


def test_each_epoch_visits_every_window_once_in_a_new_order(shards):
    windows = DatasetWindows(shards, SEQ + 1, 0, 200, seed=7)
    epoch0 = [windows.index(k) for k in range(200)]
    epoch1 = [windows.index(k) for k in range(200, 400)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(200))
    assert epoch0 != epoch1
    unshuffled = DatasetWindows(shards, SEQ + 1, 0, 200, seed=None)
    assert [unshuffled.index(k) for k in range(400)] == list(range(200)) * 2
    assert windows.tokens(5)[0] == windows.index(5) * 16 % VOCAB


# --------------------------------------------------------------------------- blend


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.25], [0.99, 0.01], [3, 0, 1]])
def test_blend_weights_hold_within_1_percent_over_10000_windows(weights):
    pattern = BlendPattern(weights)
    for start in (0, 123_457):
        counts = Counter(pattern.locate(g)[0] for g in range(start, start + 10_000))
        for d, w in enumerate(weights):
            assert abs(counts[d] / 10_000 - w / sum(weights)) < 0.01, (weights, counts)


def test_blend_visits_each_dataset_window_once_in_order():
    pattern = BlendPattern([0.6, 0.4])
    seen = {0: [], 1: []}
    for g in range(20_000):
        d, k = pattern.locate(g)
        seen[d].append(k)
    assert all(ks == list(range(len(ks))) for ks in seen.values())


@pytest.mark.parametrize("text, message", [
    ("a:0.7,b:x", "'b:x' is not folder:weight"), ("a:0,b:0", "sum to 0"), ("a:0.5,b", "'b' is not folder:weight"),
    ("a:-1,b:2", "'a:-1' is not"), ("a:nan,b:1", "'a:nan' is not"), (":1,b:1", "':1' is not"),
])  # fmt: skip
def test_blend_syntax_errors_are_one_line(text, message):
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*" + message):
        parse_blend(text, "training.dataset_path")
    assert parse_blend("web:0.7, code:0.3", "f") == [("web", 0.7), ("code", 0.3)] and parse_blend("data/x", "f") == [("data/x", 1.0)]


# --------------------------------------------------------------------------- loader


def test_batches_are_windows_with_shifted_labels(shards):
    unshuffled = stream_of(shards, seed=None)
    x, y = next(loader(unshuffled, 3))
    assert x.shape == y.shape == (3, SEQ) and x.dtype == torch.long
    for b in range(3):
        assert x[b].tolist() == list(range(b * 16, b * 16 + SEQ)) and y[b].tolist() == list(range(b * 16 + 1, b * 16 + 16))


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_ranks_partition_the_global_microbatch(shards, dp):
    B = 2
    reference = loader(stream_of(shards), B * dp)
    ranks = [loader(stream_of(shards), B, r, dp) for r in range(dp)]
    for _ in range(30):  # past one epoch of 200 windows
        want_x, want_y = next(reference)
        got = [next(r) for r in ranks]
        assert torch.equal(torch.cat([x for x, _ in got]), want_x) and torch.equal(torch.cat([y for _, y in got]), want_y)
    assert all(r.state_dict() == reference.state_dict() for r in ranks)
    same_dp_rank = loader(stream_of(shards), B, 1, dp)  # a tp peer of rank 1
    assert_same(take(same_dp_rank, 3), [ranks[1].batch_at(p) for p in range(0, 3 * B * dp, B * dp)])


@pytest.mark.parametrize("save_dp,load_dp", [(2, 4), (2, 1), (4, 2), (1, 4)])
def test_resume_at_another_dp_degree_starts_at_the_next_global_window(tmp_path, save_dp, load_dp):
    a, b = make_prepared(tmp_path / "a", 16 * 90), make_prepared(tmp_path / "b", 16 * 50, first=1000)

    def blend():
        return WindowStream([DatasetWindows(a, 16, 0, 90, 3, 0), DatasetWindows(b, 16, 0, 50, 3, 1)], [0.7, 0.3], "blend")

    global_batch = 8
    reference = loader(blend(), global_batch)
    saved = [loader(blend(), global_batch // save_dp, r, save_dp) for r in range(save_dp)]
    for _ in range(17):
        next(reference)
        for r in saved:
            next(r)
    state = saved[-1].state_dict()
    assert state == saved[0].state_dict() == reference.state_dict() == {"windows": 136, "data": "blend", "seq_len": SEQ}
    resumed = [loader(blend(), global_batch // load_dp, r, load_dp) for r in range(load_dp)]
    for r in resumed:
        r.load_state_dict(state)
    for _ in range(20):
        want_x, _ = next(reference)
        assert torch.equal(torch.cat([next(r)[0] for r in resumed]), want_x)


def test_state_round_trips_through_dcp(tmp_path, shards):
    import torch.distributed.checkpoint as dcp

    first = loader(stream_of(shards), 4)
    take(first, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: single process" notices
        dcp.save({"dataloader": first.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
        fresh = loader(stream_of(shards), 4)
        template = {"dataloader": fresh.state_dict()}
        dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_state_dict(template["dataloader"])
    assert_same(take(fresh, 60), take(first, 60))


def test_prefetch_gives_the_same_batches_and_forwards_errors(tmp_path, shards):
    assert_same(take(loader(stream_of(shards), 3), 80), take(loader(stream_of(shards), 3, prefetch=False), 80))
    path = shards.folder / "shard-00001.bin"
    raw = bytearray(path.read_bytes())
    raw[0:2] = (50_000).to_bytes(2, "little")
    path.write_bytes(bytes(raw))
    corrupted = loader(stream_of(TokenShards(shards.folder), seed=None), 4)
    with pytest.raises(TitanliteError, match=r"shard-00001\.bin is corrupted"):
        take(corrupted, 20)
    corrupted.close()


def test_state_of_other_data_warns_and_keeps_the_position(shards, caplog):
    other = loader(stream_of(shards), 2)
    with caplog.at_level("WARNING", logger="titanlite"):
        other.load_state_dict({"windows": 10, "data": "something else", "seq_len": 99})
    assert "continuing at global window 10" in caplog.text and other.windows == 10
    with pytest.raises(TitanliteError, match="^checkpoint: the saved dataloader state is not a titanlite data position"):
        other.load_state_dict({"source": "builtin"})


# --------------------------------------------------------------------------- corpus (config -> streams)


def config(path: str, **validation) -> tuple[SimpleNamespace, SimpleNamespace]:
    training = SimpleNamespace(dataset="prepared", dataset_path=path, dataset_cache_dir="", seq_len=SEQ, seed=5, shuffle=True)
    base = dict(enable=True, dataset="", dataset_path="", holdout_fraction=0.1)
    return training, SimpleNamespace(**{**base, **validation})


def fake_tokenizer(sha256: str = "0" * 64, vocab: int = VOCAB) -> SimpleNamespace:
    return SimpleNamespace(sha256=sha256, vocab_size=vocab, path="tok.model")


def test_held_out_windows_are_disjoint_from_training(tmp_path):
    make_prepared(tmp_path / "web", 16 * 300)
    make_prepared(tmp_path / "code", 16 * 120, first=7)
    corpus = open_corpus(*config(f"{tmp_path / 'web'}:0.7,{tmp_path / 'code'}:0.3"), fake_tokenizer())
    for d, (count, held) in enumerate([(300, 30), (120, 12)]):
        train_part = corpus.train.parts[d]
        trained = {train_part.index(k) for k in range(3 * len(train_part))}  # three epochs
        validated = {corpus.validation.parts[d].index(k) for k in range(len(corpus.validation.parts[d]))}
        assert len(trained) == count - held and len(validated) == held
        assert not trained & validated and trained | validated == set(range(count))
    # validation off or on: the same training windows
    quiet = open_corpus(*config(f"{tmp_path / 'web'}:0.7,{tmp_path / 'code'}:0.3", enable=False), fake_tokenizer())
    assert all(np.array_equal(quiet.train.tokens(g), corpus.train.tokens(g)) for g in range(500))


def test_mismatched_tokenizer_is_refused(tmp_path):
    make_prepared(tmp_path / "web", 16 * 30)
    for tokenizer in (fake_tokenizer(sha256="f" * 64), fake_tokenizer(vocab=32_000)):
        with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*web was prepared with another tokenizer") as info:
            open_corpus(*config(str(tmp_path / "web")), tokenizer)
        assert "\n" not in str(info.value)


def test_dataset_that_is_not_prepared_and_one_too_small(tmp_path):
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*nope is not a prepared dataset"):
        open_corpus(*config(f"{tmp_path / 'nope'}:1,{tmp_path / 'nope2'}:1"), fake_tokenizer())
    make_prepared(tmp_path / "tiny", 10)
    with pytest.raises(TitanliteError, match=r"tiny holds 10 tokens, fewer than one window"):
        open_corpus(*config(str(tmp_path / "tiny")), fake_tokenizer())


def test_build_dataloader_pins_only_on_cuda(shards):
    assert not build_dataloader(stream_of(shards), 2, 0, 1, CPU).pin_memory
    assert build_dataloader(stream_of(shards), 2, 0, 1, torch.device("cuda")).pin_memory
