"""From the `[training]` and `[validation]` config to window streams and loaders.

Every dataset is a prepared folder: `prepared` names them (one, or a weighted blend),
`builtin` and `files` are prepared into the cache on first use (cache.py). A folder whose
tokenizer is not `model.tokenizer_path` (another file, or another vocabulary) is refused.
With `training.verify_data` each shard is checked against its manifest's CRC-32s the first
time this rank reads it (token_shards.py), so a rank checks only what it trains on.

Chat data (`chat`, data/chat.py) is prepared for one window length: a folder of conversations
packed for another `training.seq_len` is refused, and its conversation counts are logged.

The held-out split: with `validation.dataset` empty, the last `holdout_fraction` of each
training dataset's windows never enter training (whether validation is on or not) and are
the validation windows, so the two sets are disjoint by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titanlite.config import SFT, parse_blend
from titanlite.data.cache import ensure_prepared
from titanlite.data.chat import ChatPacking, chat_counts, chat_packing
from titanlite.data.loader import TokenWindowLoader
from titanlite.data.token_shards import TokenShards
from titanlite.data.tokenizers import Tokenizer
from titanlite.data.windows import DatasetWindows, WindowStream, window_count
from titanlite.errors import TitanliteError
from titanlite.logging import logger

if TYPE_CHECKING:
    from titanlite.config import Training, Validation


@dataclass
class Corpus:
    """The training stream, and the validation stream (None when there is nothing to validate on)."""

    train: WindowStream
    validation: WindowStream | None


def open_datasets(
    dataset: str, dataset_path: str, tokenizer: Tokenizer, training: Training, section: str, chat: ChatPacking | None
) -> list[tuple[TokenShards, float]]:
    """The prepared folders of a validated `dataset`/`dataset_path` pair of `section`, opened
    and checked (and, with `training.verify_data`, each shard's checksums before its first
    read); first-use preparations go to `training.dataset_cache_dir`."""
    field = f"{section}.dataset_path"
    if dataset == "prepared":
        folders = parse_blend(dataset_path, field)
    else:
        prepared = ensure_prepared(dataset, dataset_path, tokenizer, training.dataset_cache_dir, chat)
        folders = [(str(prepared), 1.0)]
    opened = []
    for folder, weight in folders:
        shards = TokenShards(folder, field, training.verify_data)
        made_with = shards.manifest["tokenizer"]
        if made_with["sha256"] != tokenizer.sha256 or int(made_with["vocab_size"]) != tokenizer.vocab_size:
            raise TitanliteError(
                f"{field}: {shards.folder} was prepared with another tokenizer ({made_with.get('file')}, vocab "
                f"{made_with['vocab_size']:,}, sha256 {made_with['sha256'][:12]}) than model.tokenizer_path "
                f"{tokenizer.path} (vocab {tokenizer.vocab_size:,}, sha256 {tokenizer.sha256[:12]})"
            )
        opened.append((shards, weight))
    return opened


def _windows_of(shards: TokenShards, window: int, field: str) -> int:
    if shards.chat and shards.chat["window"] != window:
        raise TitanliteError(
            f"{field}: {shards.folder} holds conversations packed for training.seq_len {shards.chat['window'] - 1}, "
            f"not {window - 1}"
        )
    if shards.chat:
        logger.info(f"{shards.folder}: {chat_counts(shards.chat)}")
    count = window_count(shards, window)
    if count < 1:
        raise TitanliteError(
            f"{field}: {shards.folder} holds {shards.num_tokens:,} tokens, fewer than one window of "
            f"training.seq_len + 1 = {window}"
        )
    return count


def _name(dataset: str, path: str, seed: int | None) -> str:
    return f"{dataset}{':' + path if path else ''}" + (f" shuffled(seed {seed})" if seed is not None else "")


def open_corpus(training: Training, validation: Validation, tokenizer: Tokenizer, sft: SFT | None = None) -> Corpus:
    """The training stream (shuffled when `training.shuffle`) and the validation stream; `sft`
    (its defaults when None) packs `training.dataset` "chat"."""
    window = training.seq_len + 1
    sft = sft or SFT()
    chat = chat_packing(sft.chat_template, tokenizer, window, sft.overlong) if training.dataset == "chat" else None
    datasets = open_datasets(training.dataset, training.dataset_path, tokenizer, training, "training", chat)
    holdout = 0.0 if validation.dataset else validation.holdout_fraction
    seed = training.seed if training.shuffle else None
    train, held = [], []
    for salt, (shards, weight) in enumerate(datasets):
        count = _windows_of(shards, window, "training.dataset_path")
        kept = count - int(count * holdout)
        if kept < 1:
            raise TitanliteError(
                f"validation.holdout_fraction: {holdout} of the {count} windows of {shards.folder} "
                "leaves none for training"
            )
        train.append(DatasetWindows(shards, window, 0, kept, seed, salt))
        if kept < count:
            held.append((DatasetWindows(shards, window, kept, count, None), weight))
    stream = WindowStream(train, [w for _, w in datasets], _name(training.dataset, training.dataset_path, seed))
    if validation.dataset:
        return Corpus(stream, _validation_stream(validation, tokenizer, window, training))
    name = f"held-out {holdout} of {stream.name}"
    return Corpus(stream, WindowStream([p for p, _ in held], [w for _, w in held], name) if held else None)


def _validation_stream(validation: Validation, tokenizer: Tokenizer, window: int, training: Training) -> WindowStream:
    datasets = open_datasets(validation.dataset, validation.dataset_path, tokenizer, training, "validation", None)
    parts = [DatasetWindows(s, window, 0, _windows_of(s, window, "validation.dataset_path"), None) for s, _ in datasets]
    return WindowStream(parts, [w for _, w in datasets], _name(validation.dataset, validation.dataset_path, None))


def build_dataloader(
    stream: WindowStream,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    device: torch.device,
    prefetch: bool = True,
    documents: bool = False,
) -> TokenWindowLoader:
    """This dp rank's loader over `stream`; batches pinned for fast copies on CUDA; with
    `documents`, each window's document ids too (block-causal attention)."""
    return TokenWindowLoader(
        stream,
        local_batch_size,
        dp_rank,
        dp_degree,
        pin_memory=device.type == "cuda",
        prefetch=prefetch,
        documents=documents,
    )
