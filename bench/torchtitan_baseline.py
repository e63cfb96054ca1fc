"""torchtitan 0.2.2's own trainer beside titanlite's, layout by layout, in one run: global tokens/s,
their ratio and peak RSS per rank.

    /work/tt-venv/bin/python bench/torchtitan_baseline.py [--model llama3|deepseek_v3]
        [--layouts one,fsdp2,tp2,fsdp2_tp2,pp2,pp2_gpipe,ep2] [--frameworks torchtitan,titanlite]
        [--steps 20] [--warmup-steps 10] [--seq-len N] [--local-batch-size N] [--data synthetic|counting]
        [--rounds 1] [--no-cpu-bind] [--keep-logs DIR] [--titanlite-python .venv/bin/python] [-- extra torchtitan flags]

For each layout torchtitan runs, then titanlite's trainer on the same shape and settings
(bench/throughput.py's worker under titanlite's own venv, `--titanlite-python`, without its
ceiling timing), one job at a time, so host drift within the run touches both alike; the
table prints both figures and titanlite / torchtitan. Runs of the same code minutes apart
differ by 5-10% on a shared 2-core host: `--rounds N` repeats the whole sequence and prints
each framework's median and the median of the N ratios, each round's beside it. `--model deepseek_v3` is torchtitan's
deepseek_v3 `debugmodel` (MLA, 8 experts top-3 + 2 shared) against titanlite's
`torchtitan:debugmodel` flavor, the same shape (see the shim, patch 4), by default at local
batch 4 x 256 (issue 50's comparison); its `ep2` layout is titanlite's expert parallelism
over FSDP 2's ranks (torchtitan's EP needs its triton permutation kernel), printed beside
torchtitan's FSDP 2. `--model llama3` (the default) is titanlite's Llama debugmodel in
both, at local batch 8 x 512.

Why: issue 31 item 4 asks how titanlite's throughput compares with torchtitan's under the
same settings, issue 50 the same for DeepSeek-V3's debug shape. This runs torchtitan's
Trainer (its llama3 Transformer or deepseek_v3 model, parallelize_llama's or
parallelize_deepseekv3's FSDP2 / TP / loss-parallel plans, pipeline_llm with torch's 1F1B and GPipe schedules, its
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
within a few steps, a check that the layouts train. titanlite's side trains its built-in corpus
(debug_model.toml's dataset) from the same seed: with MoE the routing, so each expert's row
count, follows the data, the same number of rows in all. Process conditions as
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
import json
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
FLAVOR = "titanlite_debugmodel"  # the shim's flavor of each torchtitan family (patch 4)
TITANLITE_VOCAB = 4096  # titanlite's bundled tokenizer (assets/tokenizer/titanlite.model)
TITANLITE_PYTHON = REPO / ".venv" / "bin" / "python"


@dataclass(frozen=True)
class Model:
    """One model as both frameworks name it, and the comparison's default local shape."""

    torchtitan: str  # torchtitan's model name (its flavor: FLAVOR)
    family: str  # titanlite's
    flavor: str  # titanlite's flavor of the same shape
    seq_len: int
    local_batch_size: int


MODELS = {
    "llama3": Model("llama3", "llama3", "debugmodel", 512, 8),
    "deepseek_v3": Model("deepseek_v3", "deepseek_v3", "torchtitan:debugmodel", 256, 4),
}

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
    # titanlite's expert parallelism over FSDP 2's ranks, beside torchtitan's FSDP 2 (module docstring).
    "ep2": ("EP 2 (torchtitan: FSDP 2)", 2, ["--parallelism.expert_parallel_degree", "2"]),
}
TITANLITE_ONLY = {"ep2": "fsdp2"}  # layout -> the torchtitan layout it is printed beside
DEFAULT_LAYOUTS = {
    "llama3": ("one", "fsdp2", "tp2", "fsdp2_tp2", "pp2", "pp2_gpipe"),
    "deepseek_v3": ("one", "fsdp2", "ep2"),
}

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


def titanlite_n_params(model: Model) -> int | None:
    """Parameters of titanlite's own model of that shape at its tokenizer's vocabulary (None if it will not
    import here)."""
    try:
        import torch

        sys.path.insert(0, str(REPO))
        from titanlite.models import get_model_spec

        spec = get_model_spec(model.family)
        with torch.device("meta"):
            built = spec.model_class(spec.args_for(model.flavor, TITANLITE_VOCAB))
        return sum(p.numel() for p in built.parameters())
    except Exception as error:  # noqa: BLE001 - a missing count is reported, not fatal
        print(f"titanlite's parameter count unavailable here: {error!r}", file=sys.stderr)
        return None


def torchtitan_flags(args: argparse.Namespace, dump: Path) -> list[str]:
    return [
        "--model.name",
        MODELS[args.model].torchtitan,
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
    print(f"torchtitan {label} ({nproc} process(es) x {threads} thread(s)) ...", file=sys.stderr, flush=True)
    dump, logs = folder / name / "torchtitan" / "dump", folder / name / "torchtitan" / "logs"
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
    try:
        n_params, placement, ranks = parse_rank_logs(logs, nproc)
    except SystemExit:
        n_params, placement, ranks = 0, [], []
    complete = len(ranks) == nproc and all(len(steps) == args.steps for steps in ranks)
    if proc.returncode != 0 and not complete:
        tails = "".join(
            f"\n--- {f}\n{Path(f).read_text()[-3000:]}"
            for f in sorted(glob.glob(str(logs / "**" / "*.log"), recursive=True))
        )
        raise SystemExit(f"{label} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}{tails}")
    if proc.returncode != 0:  # e.g. gloo's teardown aborting a rank after its last step: the figures stand
        print(f"torchtitan {label}: exit {proc.returncode} after every rank logged every step", file=sys.stderr)
    if not complete:
        raise SystemExit(
            f"{label}: expected {args.steps} logged steps per rank, got {[len(s) for s in ranks]} (logs in {logs})"
        )
    return Run(nproc, threads, n_params, placement, ranks)


def titanlite_args(args: argparse.Namespace, dump: Path) -> list[str]:
    """titanlite's trainer overrides for the same settings as `torchtitan_flags` (debug_model.toml's
    optimizer, LR warm-up, max_norm, seed and no activation checkpointing are torchtitan's flags there)."""
    model = MODELS[args.model]
    return [
        *("--config", "debug_model", "--model.name", model.family, "--model.flavor", model.flavor),
        *("--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", str(args.local_batch_size), "--training.mixed_precision_param", "float32"),
        *("--compile.enable", "false", "--parallelism.pipeline_parallel_microbatch_size", "1"),
        *("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"),
        *("--checkpoint.enable_checkpoint", "false", "--job.dump_folder", str(dump)),
    ]


def launch_titanlite(args: argparse.Namespace, name: str, folder: Path) -> Run:
    """titanlite's trainer in the layout, through bench/throughput.py's worker (its "bare" mode:
    no ceiling timing) under `titanlite.launch --cpu-bind`, with titanlite's own venv."""
    label, nproc, flags = LAYOUTS[name]
    threads = max(1, usable_cores() // nproc)
    print(f"titanlite {label} ({nproc} process(es) x {threads} thread(s)) ...", file=sys.stderr, flush=True)
    dump = folder / name / "titanlite"
    dump.mkdir(parents=True)
    cmd = [
        *(args.titanlite_python, "-m", "titanlite.launch", "--standalone", f"--nproc-per-node={nproc}"),
        *(["--cpu-bind"] if args.cpu_bind else []),
        *(str(REPO / "bench" / "throughput.py"), "--worker", str(dump / "out.json"), "bare"),
        *titanlite_args(args, dump),
        *flags,
    ]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"titanlite {label} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((dump / "out.json").read_text())
    ranks = [[(h["step"], h["loss"], h["memory_gib"], h["tps"]) for h in history] for history in summary["ranks"]]
    return Run(nproc, threads, summary["n_params"], [], ranks)


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
    parser.add_argument("--model", choices=tuple(MODELS), default="llama3")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--warmup-steps", type=int, default=10, help="first steps left out of the averages")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's (512 Llama, 256 DeepSeek-V3)")
    parser.add_argument(
        "--local-batch-size", type=int, default=None, help="sequences per data-parallel rank (default: 8 Llama, 4 DSv3)"
    )
    parser.add_argument("--layouts", default=None, help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--frameworks", default="torchtitan,titanlite", help="comma-separated: torchtitan, titanlite")
    parser.add_argument("--titanlite-python", default=str(TITANLITE_PYTHON), help="the python of titanlite's venv")
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
        help="torchtitan's data: synthetic: uniform random token ids (the comparison's); counting: each row counts "
        "up from a random id, the same shapes with a learnable next token (a check that the loss falls)",
    )
    parser.add_argument(
        "--keep-logs", metavar="DIR", help="keep each run's logs under DIR/<layout>/ (default: a temporary folder)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole sequence this many times (a noisy host's runs minutes apart differ by 5-10%%): each "
        "framework's median tokens/s and the median of the rounds' ratios",
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run before it counts as hung")
    parser.add_argument("overrides", nargs="*", help="extra torchtitan flags, after --")
    return checked(parser, parser.parse_args())


def checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The model's defaults filled in; layouts and frameworks split and checked."""
    model = MODELS[args.model]
    args.seq_len = args.seq_len or model.seq_len
    args.local_batch_size = args.local_batch_size or model.local_batch_size
    layouts = args.layouts or ",".join(DEFAULT_LAYOUTS[args.model])
    args.layouts = [name.strip() for name in layouts.split(",") if name.strip()]
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)} (choose from {', '.join(LAYOUTS)})")
    args.frameworks = [name.strip() for name in args.frameworks.split(",") if name.strip()]
    if not args.frameworks or set(args.frameworks) - {"torchtitan", "titanlite"}:
        parser.error("--frameworks: choose from torchtitan, titanlite")
    return args


def run_all(args: argparse.Namespace, folder: Path) -> dict[tuple[str, str], list[Run]]:
    """(framework, layout) -> its run in each round: per round, each layout's torchtitan run, then
    titanlite's, one at a time. A titanlite-only layout's torchtitan peer runs first if it is not
    in the list."""
    runs: dict[tuple[str, str], list[Run]] = {}
    for index in range(args.rounds):
        here = folder / f"round{index}" if args.rounds > 1 else folder
        for name in args.layouts:
            peer = TITANLITE_ONLY.get(name, name)
            if "torchtitan" in args.frameworks and len(runs.get(("torchtitan", peer), [])) == index:
                runs.setdefault(("torchtitan", peer), []).append(launch(args, peer, here))
            if "titanlite" in args.frameworks:
                runs.setdefault(("titanlite", name), []).append(launch_titanlite(args, name, here))
    return runs


def describe(rounds: list[Run], warmup_steps: int) -> tuple[str, str, str]:
    """(tokens/s, loss first -> last, peak RSS) of a framework's runs of a layout as table cells
    ("-" when not run): the median tokens/s over the rounds, the first round's losses, the
    highest peak."""
    if not rounds:
        return "-", "-", "-"
    for run in rounds:
        if not all(math.isfinite(v) for v in losses(run)):
            print(f"warning: a run logged a non-finite loss: {losses(run)}", file=sys.stderr)
    values = losses(rounds[0])
    memory = max(mem for run in rounds for steps in run.steps for _, _, mem, _ in steps)
    tokens = statistics.median(global_tokens_per_s(run, warmup_steps) for run in rounds)
    return f"{tokens:,.0f}", f"{values[0]:.3f} -> {values[-1]:.3f}", f"{memory:.2f}"


def print_header(args: argparse.Namespace, runs: dict[tuple[str, str], list[Run]]) -> None:
    from importlib.metadata import version  # of the venv's packages, for the header only

    model = MODELS[args.model]
    expected = titanlite_n_params(model)
    counts = {
        f: sorted({r.n_params for (g, _), rounds in runs.items() if g == f for r in rounds})
        for f in ("torchtitan", "titanlite")
    }
    print(
        f"torchtitan {version('torchtitan')} {model.torchtitan} flavor {FLAVOR}: parameters "
        f"{', '.join(f'{c:,}' for c in counts['torchtitan']) or '-'}; titanlite {model.family} {model.flavor}: "
        f"{', '.join(f'{c:,}' for c in counts['titanlite']) or '-'} (at vocab {TITANLITE_VOCAB}: "
        f"{f'{expected:,}' if expected else '?'}); torch {version('torch')}, gloo, float32, eager, no AC"
    )
    print(
        f"seq_len {args.seq_len}, local batch {args.local_batch_size} per data-parallel rank, {args.steps} steps "
        f"(first {args.warmup_steps} left out); CPU, {usable_cores()} cores{'' if args.cpu_bind else ', unbound'}"
        + (f"; {args.rounds} rounds: medians, and each round's ratio" if args.rounds > 1 else "")
    )


def print_table(args: argparse.Namespace, runs: dict[tuple[str, str], list[Run]]) -> None:
    print(
        "\n| layout | processes x threads | torchtitan tokens/s | titanlite tokens/s | titanlite / torchtitan "
        "| peak RSS per rank GiB tt / tl | loss first -> last tt / tl |"
    )
    print("|---|---|---:|---:|---:|---|---|")
    for name in args.layouts:
        tt, tl = runs.get(("torchtitan", TITANLITE_ONLY.get(name, name)), []), runs.get(("titanlite", name), [])
        for run in (*tt, *tl):
            if any((t, i) != (run.threads, 1) for _, t, i in run.placement):
                print(
                    f"warning: {name}: ranks' (threads, inter-op) {run.placement}, expected {run.threads}",
                    file=sys.stderr,
                )
        (tt_tps, tt_loss, tt_mem), (tl_tps, tl_loss, tl_mem) = (
            describe(tt, args.warmup_steps),
            describe(tl, args.warmup_steps),
        )
        ratio = "-"
        if tt and tl:
            # Each round's titanlite run over the torchtitan run just before it: host drift
            # between rounds moves both alike, so the median of these is the steadier figure.
            each = [
                global_tokens_per_s(b, args.warmup_steps) / global_tokens_per_s(a, args.warmup_steps)
                for a, b in zip(tt, tl)
            ]
            ratio = f"**{statistics.median(each):.2f}**" + (
                f" ({', '.join(f'{r:.2f}' for r in each)})" if len(each) > 1 else ""
            )
        nproc = LAYOUTS[name][1]
        print(
            f"| {LAYOUTS[name][0]} | {nproc} x {max(1, usable_cores() // nproc)} | {tt_tps} | {tl_tps} | {ratio} "
            f"| {tt_mem} / {tl_mem} | {tt_loss} / {tl_loss} |"
        )


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        runs = run_all(args, Path(args.keep_logs or temporary))
    print_header(args, runs)
    print_table(args, runs)


if __name__ == "__main__":
    main()
