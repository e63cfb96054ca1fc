"""Data pipeline throughput: preparation with 1 and 2 tokenizer workers, then the loader of
rank 0 at dp 1, 8, 64 and 512 (the loader is built for that rank and degree; no processes).

    python bench/data_throughput.py [--seq-len 8192] [--batches 1000] [--rounds 5]

Prints figures and ratios only; nothing is asserted. The loader is read without its
prefetch thread, so the figure is the full cost of producing batches (the thread only
moves that cost off the training thread), measured in CPU seconds of the reading thread;
each figure is the best of several rounds, interleaved across degrees. The targets of issue 8: dp512/dp1 >= 0.9 on the
prepared path, and at least 50x what one H100 consumes training an 8B model
(~6,000 tokens/s), i.e. 300,000 tokens/s per rank. On-the-fly tokenizing is gone (every
dataset is prepared, on first use for the built-in corpus and small files), so there is
one path to measure: on the built-in corpus, a blend of it, and a synthetic corpus 30x larger.
Every stream is shuffled.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script

from titanlite.data.cache import ensure_prepared  # noqa: E402
from titanlite.data.loader import TokenWindowLoader  # noqa: E402
from titanlite.data.token_shards import TokenShards  # noqa: E402
from titanlite.data.shard_format import FORMAT, FORMAT_VERSION, shard_name, write_manifest  # noqa: E402
from titanlite.data.tokenizers import Tokenizer  # noqa: E402
from titanlite.data.windows import DatasetWindows, WindowStream, window_count  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "assets" / "tokenizer" / "titanlite.model"
DEGREES = (1, 8, 64, 512)
H100_8B_TOKENS_PER_S = 6_000


def children_cpu_seconds() -> float:
    """User + system time of this process's finished children (the command and its workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_prepare(folder: Path) -> dict[int, tuple[float, float, int]]:
    """workers -> (wall seconds, CPU seconds, tokens) of `python -m titanlite.data.prepare
    builtin` (the command users and the trainer's first use run)."""
    out = {}
    for workers in (1, 2):
        output = folder / f"w{workers}"
        command = [
            sys.executable,
            "-m",
            "titanlite.data.prepare",
            "builtin",
            str(output),
            "--tokenizer",
            str(TOKENIZER),
            "--workers",
            str(workers),
            "--shard-mb",
            "1",
        ]
        wall, cpu = time.perf_counter(), children_cpu_seconds()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
        tokens = json.loads((output / "manifest.json").read_text())["tokens"]
        out[workers] = (time.perf_counter() - wall, children_cpu_seconds() - cpu, tokens)
    return out


def loader_rates(stream: WindowStream, batches: int, rounds: int) -> list[float]:
    """Tokens per CPU second of rank 0 at each degree in DEGREES (local batch 1, `batches`
    batches): the best of `rounds` rounds, the degrees interleaved within each round. CPU
    time, since reads hit the page cache and wall time on a shared machine mostly measures
    the other processes."""
    loaders = [TokenWindowLoader(stream, 1, 0, dp, prefetch=False) for dp in DEGREES]
    best = [0.0] * len(DEGREES)
    for _ in range(rounds):
        for i, loader in enumerate(loaders):
            next(loader)  # the first batch of a round may map a shard
            start = time.process_time()
            for _ in range(batches):
                next(loader)
            best[i] = max(best[i], batches * loader.seq_len / (time.process_time() - start))
    return best


def synthetic(folder: Path, tokens: int, shards: int = 10) -> Path:
    """A prepared folder of `tokens` random ids (one document per shard), written with numpy
    in the format of docs/data.md: a corpus 30x the built-in one, to show the loader's
    cost does not grow with the corpus."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    per = tokens // shards
    for k in range(shards):
        rng.integers(0, 4096, per, dtype=np.uint16).astype("<u2").tofile(folder / f"{shard_name(k)}.bin")
        np.array([0, per], dtype="<u8").tofile(folder / f"{shard_name(k)}.idx")
    write_manifest(
        folder,
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dtype": "uint16",
            "source": "synthetic",
            "tokens": per * shards,
            "documents": shards,
            "tokenizer": {"kind": "none", "sha256": "", "vocab_size": 4096},
            "shards": [{"name": shard_name(k), "tokens": per, "documents": 1} for k in range(shards)],
        },
    )
    return folder


def streams(builtin: Path, large: Path, seq_len: int) -> dict[str, WindowStream]:
    window = seq_len + 1
    parts = {}
    for name, folder in (("built-in", builtin), ("synthetic", large)):
        shards = TokenShards(folder)
        parts[name] = [DatasetWindows(shards, window, 0, window_count(shards, window), seed=0, salt=s) for s in (0, 1)]
    return {
        f"built-in ({parts['built-in'][0].shards.num_tokens / 1e6:.1f}M tokens)": WindowStream(
            parts["built-in"][:1], [1.0], "a"
        ),
        "built-in, blend 0.7/0.3 of two": WindowStream(parts["built-in"], [0.7, 0.3], "b"),
        f"synthetic ({parts['synthetic'][0].shards.num_tokens / 1e6:.0f}M tokens)": WindowStream(
            parts["synthetic"][:1], [1.0], "c"
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tokenizer = Tokenizer(str(TOKENIZER))
    with tempfile.TemporaryDirectory() as tmp:
        prepared = bench_prepare(Path(tmp))
        print(f"prepare, built-in corpus ({prepared[1][2]:,} tokens, {tokenizer.kind} vocab {tokenizer.vocab_size:,}):")
        for workers, (wall, cpu, tokens) in prepared.items():
            print(
                f"  {workers} worker(s): {wall:6.1f} s wall {tokens / wall:12,.0f} tokens/s;  "
                f"{cpu:5.1f} CPU s {tokens / cpu:12,.0f} tokens per CPU second"
            )
        print(
            f"  ratio 2 workers / 1 worker: {prepared[1][0] / prepared[2][0]:.2f}x wall, "
            f"{prepared[1][1] / prepared[2][1]:.2f}x CPU (wall scales with the cores this process is given)"
        )
        start = time.perf_counter()
        ensure_prepared("builtin", "", tokenizer, str(Path(tmp) / "cache"))
        first_use = time.perf_counter() - start
        start = time.perf_counter()
        ensure_prepared("builtin", "", tokenizer, str(Path(tmp) / "cache"))
        cached = time.perf_counter() - start
        print(
            f"first use of the built-in corpus in a run: {first_use:.1f} s to prepare; later runs: {cached:.2f} s "
            "(hash and open)"
        )

        print(
            f"\nloader, rank 0, local batch 1, seq_len {args.seq_len}, best of {args.rounds} rounds of "
            f"{args.batches} batches (tokens per CPU second):"
        )
        print(
            f"  {'prepared path':<36}"
            + "".join(f"{'dp ' + str(d):>12}" for d in DEGREES)
            + f"{'dp512/dp1':>11}{'x H100 8B':>11}"
        )
        large = synthetic(Path(tmp) / "synthetic", 100_000_000)
        for name, stream in streams(Path(tmp) / "w2", large, args.seq_len).items():
            rates = loader_rates(stream, args.batches, args.rounds)
            print(
                f"  {name:<36}"
                + "".join(f"{r:12,.0f}" for r in rates)
                + f"{rates[-1] / rates[0]:11.2f}{min(rates) / H100_8B_TOKENS_PER_S:10,.0f}x"
            )


if __name__ == "__main__":
    main()
