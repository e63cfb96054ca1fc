"""titanlite/data/corpus.py (config -> streams): the held-out split is disjoint from training, a
mismatched tokenizer and a dataset not prepared or too small are refused, training.verify_data
reaches the validation data too, pinned memory only on CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers.token_data import (  # noqa: F401 (fixtures)
    SEQ,
    VOCAB,
    change_a_token_inside_the_vocabulary,
    make_prepared,
    shards,
    stream_of,
)
from titanlite.data.corpus import build_dataloader, open_corpus
from titanlite.errors import TitanliteError

CPU = torch.device("cpu")


def config(path: str, verify_data: bool = False, **validation) -> tuple[SimpleNamespace, SimpleNamespace]:
    training = SimpleNamespace(
        dataset="prepared",
        dataset_path=path,
        dataset_cache_dir="",
        seq_len=SEQ,
        seed=5,
        shuffle=True,
        verify_data=verify_data,
    )
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
        with pytest.raises(
            TitanliteError, match=r"^training\.dataset_path: .*web was prepared with another tokenizer"
        ) as info:
            open_corpus(*config(str(tmp_path / "web")), tokenizer)
        assert "\n" not in str(info.value)


def test_dataset_that_is_not_prepared_and_one_too_small(tmp_path):
    with pytest.raises(TitanliteError, match=r"^training\.dataset_path: .*nope is not a prepared dataset"):
        open_corpus(*config(f"{tmp_path / 'nope'}:1,{tmp_path / 'nope2'}:1"), fake_tokenizer())
    make_prepared(tmp_path / "tiny", 10)
    with pytest.raises(TitanliteError, match=r"tiny holds 10 tokens, fewer than one window"):
        open_corpus(*config(str(tmp_path / "tiny")), fake_tokenizer())


def test_verify_data_checks_the_validation_dataset_too(tmp_path):
    make_prepared(tmp_path / "web", 16 * 30)
    make_prepared(tmp_path / "held", 16 * 30, shard_tokens=16 * 30)
    change_a_token_inside_the_vocabulary(tmp_path / "held" / "shard-00000.bin", 3)
    corpus = open_corpus(
        *config(str(tmp_path / "web"), verify_data=True, dataset="prepared", dataset_path=str(tmp_path / "held")),
        fake_tokenizer(),
    )
    corpus.train.tokens(0)
    with pytest.raises(
        TitanliteError, match=r"^validation\.dataset_path: .*held/shard-00000\.bin is corrupted: CRC-32"
    ):
        corpus.validation.tokens(0)


def test_build_dataloader_pins_only_on_cuda(shards):
    assert not build_dataloader(stream_of(shards), 2, 0, 1, CPU).pin_memory
    assert build_dataloader(stream_of(shards), 2, 0, 1, torch.device("cuda")).pin_memory
