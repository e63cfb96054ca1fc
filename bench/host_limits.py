"""What this CPU host charges for work that runs in lockstep, in one run.

    python bench/host_limits.py [--rounds 2] [--tokens 4096] [--vocab 4096]

FSDP 2 on two cores runs two nearly independent processes: they meet only at prefetched
all-gathers and at the gradient reduce-scatter. TP 2 meets after every sub-layer, and one
process of 2 threads meets at a barrier after every OpenMP region (thousands per step). This
bench measures what such meetings cost on this host, which is what separates those layouts'
throughput in `bench/throughput.py` (see docs/performance.md):

1. gloo all-reduce time by size, 2 processes each bound to its own core. TP 2 all-reduces
   the [batch, seq, dim] float32 activations after each sub-layer: 4 MiB for the debug model
   at local batch 8 x seq 512, 24 times per step (12 forward, 12 backward).
2. Lockstep tax: the same matmul work on 2 bound processes, with no meeting and with a
   4-byte all-reduce every ~100 ms or ~20 ms of work (a TP sub-layer is 20-150 ms here).
   Each meeting waits for the slower process, so the tax is what the host's jitter costs.
3. Thread scaling of the debug model's matmuls (forward, input gradient, weight gradient
   of each linear, at `--tokens` rows): 1 thread against all usable cores' threads.
   Two single-thread processes scale by the number of cores by construction.

Needs 2 usable cores. Nothing is asserted; figures vary with the host's load, so compare
only the ratios printed in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from titanlite.models import get_model_spec  # noqa: E402

ALLREDUCE_BYTES = (4, 4 << 10, 64 << 10, 1 << 20, 4 << 20)
SEGMENTS_MS = (100, 20)
WORK_MS = 4000  # per lockstep run
MATMUL = (4096, 256, 256)  # the unit of lockstep work: [tokens, dim] x [dim, dim]


def _worker(rank: int, rendezvous: str, cores: list[int], task: str, args: tuple, results: dict) -> None:
    """One of the 2 bound gloo processes; rank 0 stores its figures in `results`."""
    os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        figures = _allreduce_times() if task == "allreduce" else _lockstep_times(*args)
        if rank == 0:
            results.update(figures)
    finally:
        dist.destroy_process_group()


def _allreduce_times() -> dict:
    """Median per-op time of back-to-back all-reduces, per size."""
    times = {}
    for nbytes in ALLREDUCE_BYTES:
        x = torch.ones(max(1, nbytes // 4))
        per_op = []
        for _ in range(7):
            ops = 40 if nbytes < 1 << 20 else 10
            start = time.perf_counter()
            for _ in range(ops):
                dist.all_reduce(x)
            per_op.append((time.perf_counter() - start) / ops)
        times[nbytes] = statistics.median(per_op[2:])
    return times


def _lockstep_times(products_per_segment: int, segments: int, meeting_first: bool) -> dict:
    """Seconds for the same work free-running and meeting after each segment (the slower
    rank's time, which is what a layout waits for); the order alternates between rounds."""
    a, b = torch.randn(MATMUL[0], MATMUL[1]), torch.randn(MATMUL[1], MATMUL[2])
    flag = torch.zeros(1)
    times = {}
    for meet in (True, False) if meeting_first else (False, True):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(segments):
            for _ in range(products_per_segment):
                torch.mm(a, b)
            if meet:
                dist.all_reduce(flag)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times[meet] = elapsed.item()
    return times


def _run_pair(cores: list[int], task: str, args: tuple = ()) -> dict:
    """`task` on 2 gloo processes that meet through a file store (no port to race for)."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as folder:
        results = manager.dict()
        mp.spawn(_worker, args=(f"{folder}/rendezvous", cores, task, args, results), nprocs=2)
        return dict(results)


def model_matmuls(tokens: int, vocab: int) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """The debug model's matmuls per linear: forward x W^T, input gradient g W, weight
    gradient g^T x (as autograd runs them: the transposed operand a strided view)."""
    args = get_model_spec("llama3").flavors["debugmodel"]
    kv = args.kv_heads * args.head_dim
    linears = {
        "wq, wo": (args.dim, args.dim),
        "wk, wv": (kv, args.dim),
        "w1, w3": (args.ffn_hidden_dim, args.dim),
        "w2": (args.dim, args.ffn_hidden_dim),
        "output": (vocab, args.dim),
    }
    shapes = []
    for name, (out_features, in_features) in linears.items():
        shapes += [
            (f"{name} forward", (tokens, in_features), (in_features, out_features)),
            (f"{name} input grad", (tokens, out_features), (out_features, in_features)),
            (f"{name} weight grad", (out_features, tokens), (tokens, in_features)),
        ]
    return shapes


def _mm_seconds(a: torch.Tensor, b: torch.Tensor, threads: int) -> float:
    """Best of several `a @ b` on `threads` threads, after one to warm up."""
    torch.set_num_threads(threads)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(8):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="lockstep measurements per segment length, interleaved")
    parser.add_argument("--tokens", type=int, default=4096, help="rows of the model's matmuls (local batch x seq)")
    parser.add_argument(
        "--vocab", type=int, default=4096, help="output head width (the bundled tokenizer's vocabulary)"
    )
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"bench/host_limits.py needs 2 usable cores; this process may use {len(cores)}")

    print("gloo all-reduce, 2 processes on cores", cores[:2])
    for nbytes, seconds in sorted(_run_pair(cores, "allreduce").items()):
        print(f"  {nbytes:>9,} B  {seconds * 1e3:6.2f} ms")

    unit_ms = 1e3 * _mm_seconds(torch.randn(MATMUL[0], MATMUL[1]), torch.randn(MATMUL[1], MATMUL[2]), threads=1)
    print(
        f"\nlockstep tax, 2 processes, {WORK_MS / 1e3:.0f} s of {MATMUL[0]}x{MATMUL[1]}x{MATMUL[2]} matmuls "
        f"({unit_ms:.1f} ms each) each:"
    )
    for round_index in range(args.rounds):
        for segment_ms in SEGMENTS_MS:
            per_segment = max(1, round(segment_ms / unit_ms))
            segments = max(1, round(WORK_MS / (per_segment * unit_ms)))
            times = _run_pair(cores, "lockstep", (per_segment, segments, round_index % 2 == 1))
            print(
                f"  meeting every {per_segment * unit_ms:5.0f} ms ({segments} meetings): free {times[False]:.2f} s, "
                f"meeting {times[True]:.2f} s, tax {times[True] / times[False] - 1:+.0%}"
            )

    threads = len(cores)
    print(f"\nmatmul thread scaling, debug model at {args.tokens} tokens: 1 thread vs {threads} (ideal {threads:.2f}x)")
    total = {1: 0.0, threads: 0.0}
    for name, shape_a, shape_b in model_matmuls(args.tokens, args.vocab):
        a = torch.randn(shape_a[1], shape_a[0]).t() if name.endswith("weight grad") else torch.randn(*shape_a)
        b = torch.randn(*shape_b)
        seconds = {n: _mm_seconds(a, b, n) for n in total}
        for n in total:
            total[n] += seconds[n]
        flops = 2 * shape_a[0] * shape_a[1] * shape_b[1]
        print(
            f"  {name:18s} {shape_a[0]:>5}x{shape_a[1]:<5}x{shape_b[1]:>5}  1 thread {flops / seconds[1] / 1e9:6.1f} "
            "GFLOP/s, "
            f"{threads} threads {flops / seconds[threads] / 1e9:6.1f} GFLOP/s, {seconds[1] / seconds[threads]:.2f}x"
        )
    print(f"  all of them: {total[1] / total[threads]:.2f}x")


if __name__ == "__main__":
    main()
