"""Data pipeline throughput: preparation with 1 and 2 tokenizer workers, then the loader of
rank 0 at dp 1, 8, 64 and 512 (the loader is built for that rank and degree; no processes).

    python bench/data_throughput.py [--seq-len 8192] [--batches 200]

Prints figures and ratios only; nothing is asserted. The loader is read without its
prefetch thread, so the figure is the full cost of producing batches (the thread only
moves that cost off the training thread). The targets of issue 8: dp512/dp1 >= 0.9 on the
prepared path, and at least 50x what one H100 consumes training an 8B model
(~6,000 tokens/s), i.e. 300,000 tokens/s per rank. On-the-fly tokenizing is gone (every
dataset is prepared, on first use for the built-in corpus and small files), so there is
one path to measure, plus a two-dataset blend of it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.data.cache import ensure_prepared  # noqa: E402
from titanlite.data.loader import TokenWindowLoader  # noqa: E402
from titanlite.data.prepare import prepare  # noqa: E402
from titanlite.data.reader import TokenShards  # noqa: E402
from titanlite.data.sources import BuiltinSource  # noqa: E402
from titanlite.data.tokenizer import Tokenizer  # noqa: E402
from titanlite.data.windows import DatasetWindows, WindowStream, window_count  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "titanlite.model"
DEGREES = (1, 8, 64, 512)
H100_8B_TOKENS_PER_S = 6_000


def bench_prepare(folder: Path, tokenizer: Tokenizer) -> dict[int, tuple[float, int]]:
    """workers -> (seconds, tokens) for the whole built-in corpus."""
    out = {}
    for workers in (1, 2):
        start = time.perf_counter()
        manifest = prepare(BuiltinSource(), tokenizer, folder / f"w{workers}", workers=workers, shard_chars=1_000_000)
        out[workers] = (time.perf_counter() - start, manifest["tokens"])
    return out


def loader_rate(stream: WindowStream, dp: int, batches: int) -> float:
    """Tokens/s of rank 0 of `dp`, local batch 1, over `batches` batches."""
    loader = TokenWindowLoader(stream, 1, 0, dp, prefetch=False)
    next(loader)  # map the first shard
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * loader.seq_len / (time.perf_counter() - start)


def streams(folder: Path, seq_len: int) -> dict[str, WindowStream]:
    shards = TokenShards(folder)
    window = seq_len + 1
    count = window_count(shards, window)
    one = DatasetWindows(shards, window, 0, count, seed=0)
    a, b = (DatasetWindows(shards, window, 0, count, seed=0, salt=salt) for salt in (0, 1))
    return {"prepared, shuffled": WindowStream([one], [1.0], "one"),
            "prepared, shuffled, blend 0.7/0.3": WindowStream([a, b], [0.7, 0.3], "blend")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    tokenizer = Tokenizer(str(TOKENIZER))
    with tempfile.TemporaryDirectory() as tmp:
        prepared = bench_prepare(Path(tmp), tokenizer)
        print(f"prepare, built-in corpus ({prepared[1][1]:,} tokens, {tokenizer.kind} vocab {tokenizer.vocab_size:,}):")
        for workers, (seconds, tokens) in prepared.items():
            print(f"  {workers} worker(s): {seconds:6.1f} s  {tokens / seconds:12,.0f} tokens/s")
        print(f"  ratio 2 workers / 1 worker: {prepared[1][0] / prepared[2][0]:.2f}x")
        start = time.perf_counter()
        ensure_prepared("builtin", "", tokenizer, str(Path(tmp) / "cache"))
        first_use = time.perf_counter() - start
        start = time.perf_counter()
        ensure_prepared("builtin", "", tokenizer, str(Path(tmp) / "cache"))
        cached = time.perf_counter() - start
        print(f"first use of the built-in corpus in a run: {first_use:.1f} s to prepare; later runs: {cached:.2f} s (hash and open)")

        print(f"\nloader, rank 0, local batch 1, seq_len {args.seq_len}, {args.batches} batches (tokens/s):")
        print(f"  {'path':<36}" + "".join(f"{'dp ' + str(d):>12}" for d in DEGREES) + f"{'dp512/dp1':>11}{'x H100 8B':>11}")
        for name, stream in streams(Path(tmp) / "w2", args.seq_len).items():
            rates = [loader_rate(stream, dp, args.batches) for dp in DEGREES]
            print(f"  {name:<36}" + "".join(f"{r:12,.0f}" for r in rates)
                  + f"{rates[-1] / rates[0]:11.2f}{min(rates) / H100_8B_TOKENS_PER_S:10,.0f}x")


if __name__ == "__main__":
    main()
