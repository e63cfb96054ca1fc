"""First-use preparation: the built-in corpus and small local files become prepared shards
in a cache, so every run trains through the same memory-mapped loader.

An entry is keyed by the source's content (SHA-256 of every byte it reads), the
tokenizer file's SHA-256 and the format version: edited files or another tokenizer make a
new entry, and an entry is never used before its manifest.json exists (the manifest is
written last, atomically). Every rank of a node (of every job sharing the cache) races for
one lock file per entry; the winner prepares with all the node's CPUs, the others wait on
the lock and then read what it wrote. A preparer that dies releases the lock with its
process, and the next one resumes its complete shards.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from titanlite.data.chat import ChatFiles, ChatPacking
from titanlite.data.shard_format import FORMAT_VERSION, MANIFEST
from titanlite.data.sources import build_source
from titanlite.data.tokenizers import Tokenizer
from titanlite.errors import TitanliteError
from titanlite.logging import logger

MAX_FIRST_USE_BYTES = 1 << 30
MAX_WORKERS = 16
WAIT_LOG_EVERY_S = 30.0
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def cache_root(configured: str) -> Path:
    """`training.dataset_cache_dir`, else $XDG_CACHE_HOME/titanlite/data, else ~/.cache/titanlite/data."""
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "titanlite" / "data"


def ensure_prepared(
    dataset: str, dataset_path: str, tokenizer: Tokenizer, cache_dir: str, chat: ChatPacking | None = None
) -> Path:
    """The cache folder holding `dataset` ("builtin", "files", or "chat" packed as `chat` says)
    prepared with `tokenizer`, preparing it first if no process has yet."""
    source = ChatFiles(dataset_path) if chat else build_source(dataset, dataset_path)
    size = source.size_bytes()
    if size > MAX_FIRST_USE_BYTES:
        raise TitanliteError(
            f"training.dataset_path: {dataset_path} holds {size / 1e9:.1f} GB, more than titanlite prepares on first "
            f"use ({MAX_FIRST_USE_BYTES / 1e9:.1f} GB); prepare it once with python -m titanlite.data.prepare "
            f"{dataset_path} DIR --tokenizer {tokenizer.path}, then train with --training.dataset prepared "
            "--training.dataset_path DIR"
        )
    made = f"{FORMAT_VERSION}\0{source.content_digest()}\0{tokenizer.sha256}" + (f"\0{chat.job()}" if chat else "")
    key = hashlib.sha256(made.encode()).hexdigest()[:16]
    root = cache_root(cache_dir)
    folder = root / f"{dataset}-{key}"
    if (folder / MANIFEST).is_file():
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TitanliteError(f"training.dataset_cache_dir: cannot create {root}: {e.strerror or e}") from None
    with open(root / f"{folder.name}.lock", "a+") as lock:
        _acquire(lock, folder)
        if not (folder / MANIFEST).is_file():
            _run_prepare("builtin" if dataset == "builtin" else dataset_path, folder, tokenizer, size, chat)
    return folder


def _acquire(lock, folder: Path) -> None:
    """Take the entry's lock, waiting (and saying so) while another process prepares it."""
    waited_since = last_log = time.monotonic()
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if now - last_log >= WAIT_LOG_EVERY_S or last_log == waited_since:
                logger.info(f"data: waiting for another process to prepare {folder} ({now - waited_since:.0f} s)")
                last_log = now
            time.sleep(0.2)


def _run_prepare(source: str, folder: Path, tokenizer: Tokenizer, size: int, chat: ChatPacking | None) -> None:
    """`python -m titanlite.data.prepare` in a child process: its workers are spawned from a
    process that imported neither torch nor the trainer, and it dies with this one."""
    workers = max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))
    shard_chars = min(max(size // (4 * workers), 1_000_000), 64_000_000)
    command = [sys.executable, "-m", "titanlite.data.prepare", source, str(folder), "--tokenizer", tokenizer.path]
    command += ["--workers", str(workers), "--shard-mb", str(shard_chars / 1e6), "--from-trainer"]
    if chat:
        command += ["--chat", str(chat.window - 1), "--chat-template", chat.configured, "--overlong", chat.overlong]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]))
    logger.info(f"data: preparing {source} into {folder} (first use; {workers} tokenizer processes)")
    result = subprocess.run(command, env=env, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        errors = [line.removeprefix("titanlite: error: ") for line in lines if line.startswith("titanlite: error: ")]
        if errors:
            raise TitanliteError(errors[-1])
        raise TitanliteError(
            f"data: preparing {source} failed (exit {result.returncode}): {lines[-1] if lines else 'no output'}"
        )
