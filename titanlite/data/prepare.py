"""Prepare a text source into token shards, once, with N tokenizer worker processes.

    python -m titanlite.data.prepare SOURCE OUTPUT [--tokenizer PATH] [--workers N] [--shard-mb M]
                                     [--chat SEQ_LEN [--chat-template FILE] [--overlong truncate|drop]]

SOURCE is `builtin` (the corpus that ships with Python), a local .txt/.jsonl/.parquet file
or folder, or `hf:NAME[:CONFIG]` (a Hugging Face dataset; `pip install titanlite[hf]`).
OUTPUT is a folder in the format of docs/data.md; train on it with
`--training.dataset prepared --training.dataset_path OUTPUT`. With `--chat`, SOURCE holds
conversations (a .jsonl file or folder, or hf:), packed into windows of SEQ_LEN + 1 tokens with
their loss masks (data/chat.py; docs/fine_tuning.md).

This process reads the source once, in order, and cuts it into units of about `--shard-mb`
million characters at document boundaries; unit k becomes shard k, tokenized and written
by a worker. The cut depends only on the source, so an interrupted run (Ctrl-C, kill -9 of
any process) started again with the same arguments keeps every complete shard, redoes the
rest and ends with files identical to an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from titanlite.data import shard_format
from titanlite.data.chat import OVERLONG, ChatFiles, ChatHF, ChatPacking, chat_counts, chat_packing, pack_shard
from titanlite.data.hf_source import HFSource
from titanlite.data.sources import BuiltinSource, FilesSource, Source
from titanlite.data.tokenizers import Tokenizer
from titanlite.errors import INTERRUPTED_EXIT_CODE, USER_ERROR_EXIT_CODE, TitanliteError, say
from titanlite.logging import init_logger, logger
from titanlite.observe.progress import Progress

JOB = "prepare.json"
DEFAULT_TOKENIZER = "assets/tokenizer/titanlite.model"
DEFAULT_SHARD_CHARS = 64_000_000


def open_source(spec: str, chat: bool = False) -> Source:
    """`builtin`, `hf:NAME[:CONFIG]`, or a local file or folder (of conversations with `chat`)."""
    if spec.startswith("hf:"):
        return (ChatHF if chat else HFSource)(spec[3:])
    return BuiltinSource() if spec == "builtin" else (ChatFiles if chat else FilesSource)(spec)


def units(texts: Iterator[str], shard_chars: int) -> Iterator[tuple[list[str], int]]:
    """Consecutive documents grouped until a group holds `shard_chars` characters, with
    the group's size in UTF-8 bytes (for progress)."""
    group: list[str] = []
    chars = size = 0
    for text in texts:
        group.append(text)
        chars += len(text)
        size += len(text.encode("utf-8", errors="replace"))
        if chars >= shard_chars:
            yield group, size
            group, chars, size = [], 0, 0
    if group:
        yield group, size


# --------------------------------------------------------------------------- workers

_TOKENIZER: Tokenizer | None = None
_CHAT: ChatPacking | None = None


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent exits, so no worker outlives a killed run."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        parent = os.getppid()
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def _init_worker(tokenizer_path: str, chat: ChatPacking | None) -> None:
    global _TOKENIZER, _CHAT
    die_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process (tokenizer.json)
    _TOKENIZER, _CHAT = Tokenizer(tokenizer_path), chat


def _tokenize_shard(folder: str, index: int, texts: list[str], dtype_name: str) -> dict[str, Any]:
    if _CHAT is None:
        return shard_format.write_shard(Path(folder), index, _TOKENIZER.encode_documents(texts), dtype_name)
    documents, masks, counts = pack_shard(texts, _TOKENIZER, _CHAT)
    return shard_format.write_shard(Path(folder), index, documents, dtype_name, (masks, counts))


# --------------------------------------------------------------------------- the job


def _check_job(folder: Path, job: dict[str, Any]) -> None:
    """Record what this folder is being prepared from; refuse to resume another job there."""
    path = folder / JOB
    if path.is_file():
        if (previous := json.loads(path.read_text())) != job:
            changed = ", ".join(k for k in job if previous.get(k) != job[k])
            raise TitanliteError(
                f"OUTPUT: {folder} holds a preparation with other settings ({changed}); "
                "use the same arguments to resume it, or an empty folder"
            )
        return
    if any(folder.glob("shard-*")) or (folder / shard_format.MANIFEST).exists():
        raise TitanliteError(f"OUTPUT: {folder} holds files of another preparation; use an empty folder")
    path.write_text(json.dumps(job, indent=1) + "\n")


def _tokenize_all(
    source: Source,
    tokenizer: Tokenizer,
    folder: Path,
    workers: int,
    shard_chars: int,
    progress: Progress,
    chat: ChatPacking | None,
) -> list[dict[str, Any]]:
    """Every unit of the source as a shard (complete ones kept); manifest entries in order."""
    dtype = shard_format.token_dtype(tokenizer.vocab_size)
    entries: dict[int, dict[str, Any]] = {}
    pending: dict[Future, tuple[int, int]] = {}

    def collect(futures) -> None:
        for future in futures:
            index, size = pending.pop(future)
            entries[index] = future.result()
            progress.advance(size)

    context = multiprocessing.get_context("spawn")  # never fork a process that holds threads
    initargs = (tokenizer.path, chat)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=initargs) as pool:
        for index, (texts, size) in enumerate(units(source.one_pass(), shard_chars)):
            if (done := shard_format.complete_shard(folder, index, dtype, chat is not None)) is not None:
                entries[index] = done
                progress.advance(size)
                continue
            while len(pending) > workers:
                collect(wait(pending, return_when=FIRST_COMPLETED).done)
            pending[pool.submit(_tokenize_shard, str(folder), index, texts, dtype)] = (index, size)
        collect(list(pending))
    return [entries[i] for i in range(len(entries))]


def prepare(
    source: Source,
    tokenizer: Tokenizer,
    output: str | Path,
    workers: int = 1,
    shard_chars: int = DEFAULT_SHARD_CHARS,
    chat: ChatPacking | None = None,
) -> dict[str, Any]:
    """Prepare `source` into `output` (resuming an unfinished run); returns the manifest.
    `chat`: the source holds conversations (chat.py), packed and masked so."""
    folder = Path(output)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TitanliteError(f"OUTPUT: cannot create {folder}: {e.strerror or e}") from None
    dtype = shard_format.token_dtype(tokenizer.vocab_size)
    job = {
        "format_version": shard_format.FORMAT_VERSION,
        "source": source.name,
        "tokenizer_sha256": tokenizer.sha256,
        "dtype": dtype,
        "shard_chars": shard_chars,
        **({"chat": chat.job()} if chat else {}),
    }
    with open(folder / ".lock", "a+") as lock:  # held until the end; released by the kernel if this process dies
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TitanliteError(f"OUTPUT: another prepare is writing {folder}") from None
        _check_job(folder, job)
        if (folder / shard_format.MANIFEST).is_file():
            return json.loads((folder / shard_format.MANIFEST).read_text())
        shard_format.remove_temporaries(folder)
        size = source.size_bytes() if hasattr(source, "size_bytes") else None
        progress = Progress(f"prepare {source.name}", total=size, unit="B")
        entries = _tokenize_all(source, tokenizer, folder, workers, shard_chars, progress, chat)
        manifest = _manifest(source, tokenizer, dtype, entries, job.get("chat"))
        shard_format.write_manifest(folder, manifest)
        progress.finish()
        return manifest


def _manifest(
    source: Source, tokenizer: Tokenizer, dtype: str, entries: list[dict[str, Any]], chat: dict[str, Any] | None
) -> dict[str, Any]:
    """manifest.json's content (docs/data.md): the format, what the shards were made from, and the
    shards; for chat data, its packing and conversation counts."""
    counts = ("conversations", "truncated", "dropped")
    return {
        "format": shard_format.FORMAT,
        "format_version": shard_format.FORMAT_VERSION,
        "dtype": dtype,
        "source": source.name,
        "tokens": sum(e["tokens"] for e in entries),
        "documents": sum(e["documents"] for e in entries),
        "tokenizer": {
            "file": Path(tokenizer.path).name,
            "kind": tokenizer.kind,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
        },
        "shards": entries,
        **({"chat": {**chat, **{k: sum(e[k] for e in entries) for k in counts}}} if chat else {}),
    }


# --------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every titanlite error
        print(f"titanlite: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT_CODE)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(
        prog="python -m titanlite.data.prepare",
        description=__doc__.split("\n\n")[0],
        epilog="The on-disk format is described in docs/data.md.",
    )
    parser.add_argument(
        "source", metavar="SOURCE", help="builtin, a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG]"
    )
    parser.add_argument("output", metavar="OUTPUT", help="folder to write (an unfinished one is resumed)")
    parser.add_argument(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        help="sentencepiece model, tiktoken rank file "
        f"(Llama 3 tokenizer.model) or tokenizer.json (default {DEFAULT_TOKENIZER})",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="tokenizer processes (default: the CPUs available)",
    )
    parser.add_argument(
        "--shard-mb",
        type=float,
        default=DEFAULT_SHARD_CHARS / 1e6,
        help="text per shard, in millions of characters (default 64)",
    )
    _chat_arguments(parser)
    # The trainer's first-use run: die with the trainer, and name its config keys in errors.
    parser.add_argument("--from-trainer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workers < 1 or not args.shard_mb > 0:
        parser.error("--workers must be >= 1 and --shard-mb > 0")
    if args.chat is not None and args.chat < 1:
        parser.error("--chat must be >= 1")
    return args


def _chat_arguments(parser: argparse.ArgumentParser) -> None:
    """--chat and its options (data/chat.py; docs/fine_tuning.md)."""
    parser.add_argument(
        "--chat",
        type=int,
        metavar="SEQ_LEN",
        help="SOURCE holds conversations (JSONL messages or prompt/completion): pack them into windows of "
        "SEQ_LEN + 1 tokens, trained on the assistant's tokens only",
    )
    parser.add_argument("--chat-template", default="", help="with --chat: a Jinja file (default: the tokenizer's own)")
    parser.add_argument("--overlong", choices=OVERLONG, default="truncate", help="with --chat: a longer conversation")


# Source and tokenizer errors name the training config keys; here they are arguments.
CLI_NAMES = {
    "training.dataset_path": "SOURCE",
    "training.dataset": "SOURCE",
    "model.tokenizer_path": "--tokenizer",
    "sft.chat_template": "--chat-template",
}


def _cli_message(error: TitanliteError) -> str:
    key, _, rest = str(error).partition(": ")
    return f"{CLI_NAMES[key]}: {rest}" if key in CLI_NAMES else str(error)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_trainer:
        die_with_parent()
    init_logger(0)
    try:
        tokenizer, chat = Tokenizer(args.tokenizer), None
        if args.chat is not None:
            chat = chat_packing(args.chat_template, tokenizer, args.chat + 1, args.overlong)
        source = open_source(args.source, chat is not None)
        manifest = prepare(source, tokenizer, args.output, args.workers, int(args.shard_mb * 1e6), chat)
    except TitanliteError as error:
        say(f"titanlite: error: {error if args.from_trainer else _cli_message(error)}")
        return USER_ERROR_EXIT_CODE
    except BrokenProcessPool:  # a tokenizer worker ended without finishing its shard (killed, out of memory)
        say(
            "titanlite: error: a tokenizer worker died before finishing its shard; run the same command again "
            f"to resume {args.output}"
        )
        return 1
    except KeyboardInterrupt:
        say(f"titanlite: error: interrupted; run the same command again to resume {args.output}")
        return INTERRUPTED_EXIT_CODE
    logger.info(
        f"{args.output}: {manifest['tokens']:,} tokens, {manifest['documents']:,} documents, "
        f"{len(manifest['shards'])} shards ({manifest['dtype']})"
    )
    if "chat" in manifest:
        logger.info(chat_counts(manifest["chat"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
