"""Train the bundled sentencepiece tokenizer on the built-in corpus.

    python scripts/train_tokenizer.py                 # -> assets/tokenizer/titanlite.model
    python scripts/train_tokenizer.py --vocab-size 8192 --output /tmp/tok8k.model

How the shipped `assets/tokenizer/titanlite.model` was made: this script with its
defaults (vocab 4096) on CPython 3.11.7, whose built-in corpus is the 79 `pydoc_data`
topics and 601 standard-library `.py` files (about 11.5 M characters); about 7 seconds
on 2 cores. Its text is what `titanlite.data.sources.BuiltinSource` yields, cut at line
boundaries into training sentences of about 1,500 characters that keep their newlines
(so "\\n" and indentation get pieces of their own). Of those, the trainer samples at most
`--max-sentences` (default 20,000, which at 3.11.7 is all ~8,000 of them) with a fixed
seed, so the run is bounded on any Python and repeatable on one.

The settings follow Llama 2's tokenizer: BPE, byte fallback (any UTF-8 text round-trips),
identity normalization, no whitespace collapsing (code keeps its indentation), a dummy
prefix space, digits split, whitespace-only pieces allowed; unk=0, bos=1, eos=2, no pad.
Another Python version ships other text, so a retrained model can differ; the shipped
file is what runs use.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

try:
    from titanlite.data.sources import BuiltinSource
except ImportError:  # run as `python scripts/train_tokenizer.py` without the repo on PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from titanlite.data.sources import BuiltinSource

SEED = 1234
SENTENCE_CHARS = 1500


def training_sentences(chars_per_sentence: int = SENTENCE_CHARS) -> Iterator[str]:
    """The built-in corpus, each document cut at line boundaries into pieces of about
    `chars_per_sentence` characters (newlines kept). A longer single line is its own piece."""
    for text in BuiltinSource().one_pass():
        piece: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            if piece and size + len(line) > chars_per_sentence:
                yield "".join(piece)
                piece, size = [], 0
            piece.append(line)
            size += len(line)
        if piece and "".join(piece).strip():
            yield "".join(piece)


def train(vocab_size: int, max_sentences: int, threads: int) -> bytes:
    spm.set_random_generator_seed(SEED)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=training_sentences(),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        max_sentence_length=8192,  # bytes; longer sentences (rare: long lines) are skipped
        num_threads=threads,
        minloglevel=2,
    )
    return model.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=4096, help="pieces in the model (default 4096)")
    parser.add_argument("--output", default="assets/tokenizer/titanlite.model", help="where to write the .model file")
    parser.add_argument("--max-sentences", type=int, default=20_000, help="sample at most this many training sentences")
    parser.add_argument("--threads", type=int, default=2, help="trainer threads (default 2)")
    args = parser.parse_args(argv)
    if args.vocab_size < 300:
        parser.error("--vocab-size must be at least 300 (256 byte pieces + specials + merges)")

    started = time.perf_counter()
    proto = train(args.vocab_size, args.max_sentences, args.threads)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(proto)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    print(f"wrote {out}: vocab {sp.GetPieceSize()}, {len(proto):,} bytes, {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
