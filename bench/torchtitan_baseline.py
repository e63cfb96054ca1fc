"""torchtitan 0.2.2's own trainer in bench/throughput.py's layouts and settings: global tokens/s to compare.

    /work/tt-venv/bin/python bench/torchtitan_baseline.py [--layouts one,fsdp2,tp2,fsdp2_tp2,pp2,pp2_gpipe]
        [--steps 20] [--warmup-steps 10] [--seq-len 512] [--local-batch-size 8] [--data synthetic|counting]
        [--no-cpu-bind] [--keep-logs DIR] [-- extra torchtitan flags]

To compare, on a quiet host, one after the other (each prints a markdown table):

    .venv/bin/python bench/throughput.py --settings fp32 --layouts one,fsdp2,tp2,fsdp2_tp2,pp2,pp2_gpipe
    /work/tt-venv/bin/python bench/torchtitan_baseline.py

Why: issue 31 item 4 asks how titanlite's throughput compares with torchtitan's under the
same settings. This runs torchtitan's Trainer (its llama3 Transformer, parallelize_llama's
FSDP2 / TP / loss-parallel plans, pipeline_llm with torch's 1F1B and GPipe schedules, its
cross-entropy loss, AdamW container, LR schedule, gradient clipping and train step, all
unmodified) through bench/torchtitan_shim.py, which only makes torchtitan 0.2.2 start on a
CPU-only host with torch 2.13 (its docstring lists each run-time patch and why), and
prints the figure bench/throughput.py prints for titanlite.

Setup (a venv of its own; titanlite's .venv is not touched):

    python3 -m venv /work/tt-venv
    /work/tt-venv/bin/pip install torch==2.13.0                      # the CPU build
    /work/tt-venv/bin/pip install --no-deps torchtitan==0.2.2 torchdata   # or the downloaded wheel
    /work/tt-venv/bin/pip install tomli tyro tensorboard einops tokenizers datasets requests urllib3

Settings, as bench/throughput.py's `fp32` setting on CPU: titanlite's Llama `debugmodel`
registered as torchtitan llama3 flavor `titanlite_debugmodel` (same shapes, 6,819,072
parameters; the start-up line checks the count against titanlite's own model), float32
(`training.mixed_precision_param float32`, so FSDP2 neither casts nor reduces in bf16),
eager (no compile), no activation checkpointing (torchtitan's default is selective), AdamW
lr 8e-4 eps 1e-8 weight decay 0.1 (fused), 10 warm-up steps of the LR, max_norm 1.0, seed
42, every step logged; gloo; `--seq-len` x `--local-batch-size` per data-parallel rank;
pipelines in microbatches of one sequence (8 per step at the default batch), torchtitan's
own split (stage 0: embedding and layers 0-2; stage 1: layers 3-5, norm and output). The
data are uniform random token ids of that shape (torchtitan's c4_test files are not in its
wheel; see the shim), so neither framework spends time tokenizing; on such data the loss
can only fall from ~8.8 towards ln 4096 = 8.32, slowly. `--data counting` (each row counts
up from a random id: the same shapes, a learnable next token) shows the loss falling
within a few steps, a check that the layouts train. Process conditions as
titanlite's launcher sets for CPU workers (titanlite/launch/__init__.py): OMP_NUM_THREADS = usable
cores / processes (at least 1), OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000, one inter-op
thread, and, unless `--no-cpu-bind`, each local rank bound to its own block of cores by
titanlite's own `core_blocks` rule (bench/throughput.py runs titanlite with `--cpu-bind`).
Each layout is one `torchrun --standalone` run, one after another.

Global tokens/s, as bench/throughput.py defines it: tokens of all data-parallel ranks per
second of wall time, averaged over the steps after `--warmup-steps`. torchtitan logs, on
every rank and every step, `tps` = tokens this rank's data loader produced since the last
log / (seconds since the last log x cp x tp x pp) (components/metrics.py: tokens per second
per device, from the local batch). A rank's steady rate is the harmonic mean of its `tps`
over the steps after warm-up (every step has the same token count, so that is its tokens
over its time); the sum of that over all dp x cp x tp x pp ranks is dp x local tokens per
second: every data-parallel rank's tokens counted once (a TP or PP group's ranks each add
1/(tp x pp) of their group's). That is how bench/throughput.py turns titanlite's
per-device `tps` into global tokens/s too. torchtitan's per-step interval spans the whole
step (data, forward/backward, clipping, optimizer, the loss reduction for the log).

The runs must succeed and log every step on every rank; a parameter count other than
titanlite's, a non-finite loss or a rank not on the expected threads is reported, not fatal.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "bench" / "torchtitan_shim.py"
FLAVOR = "titanlite_debugmodel"
TITANLITE_VOCAB = 4096  # titanlite's bundled tokenizer (assets/tokenizer/titanlite.model)

# name: (label, processes, torchtitan flags); data parallelism (dp_shard = -1) fills what TP / PP leave.
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "one": ("1 process", 1, []),
    "fsdp2": ("FSDP 2", 2, []),
    "tp2": ("TP 2", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": ("FSDP 2 x TP 2", 4, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (
        "PP 2 (1F1B)",
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"],
    ),
    "pp2_gpipe": (
        "PP 2 (GPipe)",
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "GPipe"],
    ),
}
DEFAULT_LAYOUTS = tuple(LAYOUTS)

STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
SIZE_LINE = re.compile(r"size:\s*([\d,]+) total parameters")
CORES_LINE = re.compile(r"tt_baseline: rank \d+ cores (\S+) threads (\d+) interop (\d+)")


@dataclass(frozen=True)
class Run:
    processes: int
    threads: int
    n_params: int
    placement: list[tuple[str, int, int]]  # per rank: (cores it is bound to, intra-op threads, inter-op threads)
    steps: list[list[tuple[int, float, float, float]]]  # per rank: (step, loss, memory GiB, tps)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def titanlite_n_params() -> int | None:
    """Parameters of titanlite's own debugmodel at its tokenizer's vocabulary (None if it will not import here)."""
    try:
        import dataclasses

        import torch

        sys.path.insert(0, str(REPO))
        from titanlite.models.llama import llama3_flavors
        from titanlite.models.llama.model import Llama

        with torch.device("meta"):
            model = Llama(dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=TITANLITE_VOCAB))
        return sum(p.numel() for p in model.parameters())
    except Exception as error:  # noqa: BLE001 - a missing count is reported, not fatal
        print(f"titanlite's parameter count unavailable here: {error!r}", file=sys.stderr)
        return None


def torchtitan_flags(args: argparse.Namespace, dump: Path) -> list[str]:
    return [
        "--model.name",
        "llama3",
        "--model.flavor",
        FLAVOR,
        "--training.steps",
        str(args.steps),
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        str(args.local_batch_size),
        "--training.dtype",
        "float32",
        "--training.mixed_precision_param",
        "float32",
        "--activation_checkpoint.mode",
        "none",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
        "--optimizer.name",
        "AdamW",
        "--optimizer.lr",
        "8e-4",
        "--optimizer.eps",
        "1e-8",
        "--lr_scheduler.warmup_steps",
        "10",
        "--training.max_norm",
        "1.0",
        "--debug.seed",
        "42",
        "--metrics.log_freq",
        "1",
        "--metrics.disable_color_printing",
        "--comm.init_timeout_seconds",
        "600",
        "--comm.train_timeout_seconds",
        "600",
        "--job.dump_folder",
        str(dump),
    ]


def worker_env(nproc: int, cpu_bind: bool, threads: int, data: str) -> dict[str, str]:
    """titanlite's launcher's CPU conditions (see the module docstring)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        OMP_WAIT_POLICY="PASSIVE",
        GOMP_SPINCOUNT="1000",
        TT_BASELINE_DATA=data,
    )
    env.pop("TT_BASELINE_CPU_BIND", None)
    if cpu_bind:
        sys.path.insert(0, str(REPO))
        from titanlite.runtime.cpu_binding import core_blocks, encode  # stdlib only

        env["TT_BASELINE_CPU_BIND"] = encode(core_blocks(sorted(os.sched_getaffinity(0)), nproc))
    return env


def parse_rank_logs(
    log_dir: Path, nproc: int
) -> tuple[int, list[tuple[str, int, int]], list[list[tuple[int, float, float, float]]]]:
    """The logged parameter count, every rank's placement (the shim's line) and logged steps,
    from torchrun's per-rank files."""
    n_params, placement, ranks = 0, [], []
    for rank in range(nproc):
        files = glob.glob(str(log_dir / "**" / "attempt_*" / str(rank) / "stdout.log"), recursive=True)
        if len(files) != 1:
            raise SystemExit(f"expected one stdout.log for rank {rank} under {log_dir}, found {files}")
        text = Path(files[0]).read_text()
        sizes = SIZE_LINE.findall(text)
        n_params = n_params or (int(sizes[0].replace(",", "")) if sizes else 0)
        placement += [(cores, int(threads), int(interop)) for cores, threads, interop in CORES_LINE.findall(text)[:1]]
        ranks.append(
            [
                (int(s), float(loss), float(mem), float(tps.replace(",", "")))
                for s, loss, mem, tps in STEP_LINE.findall(text)
            ]
        )
    return n_params, placement, ranks


def launch(args: argparse.Namespace, name: str, folder: Path) -> Run:
    label, nproc, flags = LAYOUTS[name]
    threads = max(1, usable_cores() // nproc)
    print(f"running {label} ({nproc} process(es) x {threads} thread(s)) ...", file=sys.stderr, flush=True)
    dump, logs = folder / name / "dump", folder / name / "logs"
    logs.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        str(SHIM),
        *torchtitan_flags(args, dump),
        *flags,
        *args.overrides,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=worker_env(nproc, args.cpu_bind, threads, args.data),
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if proc.returncode != 0:
        tails = "".join(
            f"\n--- {f}\n{Path(f).read_text()[-3000:]}"
            for f in sorted(glob.glob(str(logs / "**" / "*.log"), recursive=True))
        )
        raise SystemExit(f"{label} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}{tails}")
    n_params, placement, ranks = parse_rank_logs(logs, nproc)
    if any(len(steps) != args.steps for steps in ranks):
        raise SystemExit(
            f"{label}: expected {args.steps} logged steps per rank, got {[len(s) for s in ranks]} (logs in {logs})"
        )
    return Run(nproc, threads, n_params, placement, ranks)


def global_tokens_per_s(run: Run, warmup_steps: int) -> float:
    """Sum over ranks of each rank's harmonic-mean `tps` after warm-up (module docstring)."""
    total = 0.0
    for steps in run.steps:
        steady = [tps for step, _, _, tps in steps if step > warmup_steps]
        if not steady:
            raise SystemExit(f"no steps after --warmup-steps {warmup_steps}; raise --steps")
        total += statistics.harmonic_mean(steady)
    return total


def losses(run: Run) -> list[float]:
    """The logged loss per step, from a rank that computes it (a first pipeline stage logs -1)."""
    for steps in run.steps:
        if all(loss != -1.0 for _, loss, _, _ in steps):
            return [loss for _, loss, _, _ in steps]
    raise SystemExit("no rank logged a loss")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--warmup-steps", type=int, default=10, help="first steps left out of the averages")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--local-batch-size", type=int, default=8, help="sequences per data-parallel rank per step")
    parser.add_argument(
        "--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}"
    )
    parser.add_argument(
        "--no-cpu-bind",
        dest="cpu_bind",
        action="store_false",
        help="leave the workers unbound (default: each local rank on its own block of cores, as titanlite's "
        "--cpu-bind)",
    )
    parser.add_argument(
        "--data",
        choices=("synthetic", "counting"),
        default="synthetic",
        help="synthetic: uniform random token ids (the comparison's); counting: each row counts up from a random "
        "id, the same shapes with a learnable next token (a check that the loss falls)",
    )
    parser.add_argument(
        "--keep-logs",
        metavar="DIR",
        help="keep each run's per-rank torchtitan logs under DIR/<layout>/ (default: a temporary folder)",
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run before it counts as hung")
    parser.add_argument("overrides", nargs="*", help="extra torchtitan flags, after --")
    args = parser.parse_args()
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)} (choose from {', '.join(LAYOUTS)})")
    return args


def main() -> None:
    args = parse_args()
    expected = titanlite_n_params()
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(args.keep_logs or temporary)
        for name in args.layouts:
            runs[name] = launch(args, name, folder)
    from importlib.metadata import version  # of the venv's packages, for the header only

    counts = {run.n_params for run in runs.values()}
    check = (
        "equal"
        if expected is not None and counts == {expected}
        else "DIFFERENT"
        if expected is not None
        else "not checked"
    )
    print(
        f"torchtitan {version('torchtitan')} llama3 flavor {FLAVOR}: {', '.join(f'{c:,}' for c in sorted(counts))} "
        "parameters "
        f"(titanlite debugmodel: {f'{expected:,}' if expected else '?'}; {check}); torch {version('torch')}, gloo, "
        "float32, eager"
    )
    print(
        f"seq_len {args.seq_len}, local batch {args.local_batch_size} per data-parallel rank, {args.steps} steps "
        f"(first {args.warmup_steps} left out); CPU, {usable_cores()} cores{'' if args.cpu_bind else ', unbound'}"
    )
    print()
    print(
        "| layout | processes x threads | cores per rank | global tokens/s | loss step 1 -> last | peak RSS per rank |"
    )
    print("|---|---|---|---:|---|---:|")
    for name, run in runs.items():
        values = losses(run)
        if not all(math.isfinite(v) for v in values):
            print(f"warning: {LAYOUTS[name][0]} logged a non-finite loss: {values}", file=sys.stderr)
        memory = max(mem for steps in run.steps for _, _, mem, _ in steps)
        cores = " / ".join(c for c, _, _ in run.placement)
        if any((threads, interop) != (run.threads, 1) for _, threads, interop in run.placement):
            print(
                f"warning: {LAYOUTS[name][0]}: ranks' (threads, inter-op threads) {run.placement}, expected "
                f"({run.threads}, 1)",
                file=sys.stderr,
            )
        print(
            f"| {LAYOUTS[name][0]} | {run.processes} x {run.threads} | {cores} | "
            f"{global_tokens_per_s(run, args.warmup_steps):,.0f} | "
            f"{values[0]:.4f} -> {values[-1]:.4f} | {memory:.2f} GiB |"
        )
    if "fsdp2" in runs:
        base = global_tokens_per_s(runs["fsdp2"], args.warmup_steps)
        print()
        print(
            "; ".join(
                f"{LAYOUTS[n][0]} / FSDP 2 = {global_tokens_per_s(r, args.warmup_steps) / base:.2f}"
                for n, r in runs.items()
                if n != "fsdp2"
            )
        )


if __name__ == "__main__":
    main()
