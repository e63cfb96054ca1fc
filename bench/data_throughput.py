"""Data pipeline throughput: preparation with 1 and 2 tokenizer workers, then the loader of
rank 0 at dp 1, 8, 64 and 512 (the loader is built for that rank and degree; no processes).

    python bench/data_throughput.py [--seq-len 8192] [--batches 200] [--rounds 7]

Prints figures and ratios only; nothing is asserted. The loader is read without its
prefetch thread, so the figure is the full cost of producing batches (the thread only
moves that cost off the training thread); each figure is the best of several rounds,
interleaved across degrees, since the machine is shared. The targets of issue 8: dp512/dp1 >= 0.9 on the
prepared path, and at least 50x what one H100 consumes training an 8B model
(~6,000 tokens/s), i.e. 300,000 tokens/s per rank. On-the-fly tokenizing is gone (every
dataset is prepared, on first use for the built-in corpus and small files), so there is
one path to measure, plus a two-dataset blend of it.
"""

from __future__ import annotations

import argparse
import resource
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


def cpu_seconds() -> float:
    """User + system time of this process and its finished children (the tokenizer workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench_prepare(folder: Path, tokenizer: Tokenizer) -> dict[int, tuple[float, float, int]]:
    """workers -> (wall seconds, CPU seconds, tokens) for the whole built-in corpus."""
    out = {}
    for workers in (1, 2):
        wall, cpu = time.perf_counter(), cpu_seconds()
        manifest = prepare(BuiltinSource(), tokenizer, folder / f"w{workers}", workers=workers, shard_chars=1_000_000)
        out[workers] = (time.perf_counter() - wall, cpu_seconds() - cpu, manifest["tokens"])
    return out


def loader_rates(stream: WindowStream, batches: int, rounds: int) -> list[float]:
    """Tokens/s of rank 0 at each degree in DEGREES (local batch 1, `batches` batches): the
    best of `rounds` rounds, the degrees interleaved within each round, so load from other
    processes on the machine hits every degree alike."""
    loaders = [TokenWindowLoader(stream, 1, 0, dp, prefetch=False) for dp in DEGREES]
    best = [0.0] * len(DEGREES)
    for _ in range(rounds):
        for i, loader in enumerate(loaders):
            next(loader)  # the first batch of a round may map a shard
            start = time.perf_counter()
            for _ in range(batches):
                next(loader)
            best[i] = max(best[i], batches * loader.seq_len / (time.perf_counter() - start))
    return best


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
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    tokenizer = Tokenizer(str(TOKENIZER))
    with tempfile.TemporaryDirectory() as tmp:
        prepared = bench_prepare(Path(tmp), tokenizer)
        print(f"prepare, built-in corpus ({prepared[1][1]:,} tokens, {tokenizer.kind} vocab {tokenizer.vocab_size:,}):")
        for workers, (wall, cpu, tokens) in prepared.items():
            print(f"  {workers} worker(s): {wall:6.1f} s wall {tokens / wall:12,.0f} tokens/s;  "
                  f"{cpu:5.1f} CPU s {tokens / cpu:12,.0f} tokens per CPU second")
        print(f"  ratio 2 workers / 1 worker: {prepared[1][0] / prepared[2][0]:.2f}x wall, "
              f"{prepared[1][1] / prepared[2][1]:.2f}x CPU (wall scales with the cores this process is given)")
        start = time.perf_counter()
        ensure_prepared("builtin", "", tokenizer, str(Path(tmp) / "cache"))
        first_use = time.perf_counter() - start
        start = time.perf_counter()
        ensure_prepared("builtin", "", tokenizer, str(Path(tmp) / "cache"))
        cached = time.perf_counter() - start
        print(f"first use of the built-in corpus in a run: {first_use:.1f} s to prepare; later runs: {cached:.2f} s (hash and open)")

        print(f"\nloader, rank 0, local batch 1, seq_len {args.seq_len}, best of {args.rounds} rounds of {args.batches} batches (tokens/s):")
        print(f"  {'path':<36}" + "".join(f"{'dp ' + str(d):>12}" for d in DEGREES) + f"{'dp512/dp1':>11}{'x H100 8B':>11}")
        for name, stream in streams(Path(tmp) / "w2", args.seq_len).items():
            rates = loader_rates(stream, args.batches, args.rounds)
            print(f"  {name:<36}" + "".join(f"{r:12,.0f}" for r in rates)
                  + f"{rates[-1] / rates[0]:11.2f}{min(rates) / H100_8B_TOKENS_PER_S:10,.0f}x")


if __name__ == "__main__":
    main()
