"""Training throughput per parallel layout, in float32 and in the best correct setting, in one run.

    python bench/throughput.py [--steps 20] [--warmup-steps 10] [--seq-len 512] [--local-batch-size 8]
                               [--layouts one,fsdp2,tp2,fsdp2_tp2] [--profile] [-- extra trainer overrides]

Each (layout, setting) is a real run of `titanlite.trainer`'s Trainer under `python -m
titanlite.launch --standalone` (gloo on CPU, NCCL on GPUs; on CPU with `--cpu-bind`, each
rank on its own block of the cores, unless `--no-cpu-bind`) on the debug model, with the same
local batch per data-parallel rank, so FSDP 2 trains twice the tokens per step of 1 process
or TP 2. Settings:

- fp32: float32 compute, eager;
- best: the compute dtype `mixed_precision_param = "auto"` picks on this host (decided once
  here, with all cores' threads, and passed to every run), eager and with torch.compile per
  block; the faster of the two is the layout's best. Both are tested correct (bf16 within
  the documented tolerance of float32, compile within tolerance of eager).

Figures, averaged over the steps after `--warmup-steps` (the trainer logs every step):

- global tokens/s: tokens of all data-parallel ranks per second of wall time;
- model FLOP/s: global tokens/s x the trainer's FLOPs per token (6 per matmul weight plus
  attention, PaLM's accounting);
- % of peak: model FLOP/s over the matmul peak of the run's compute dtype on the hardware
  the layout uses: on CPU a 2048^3 `F.linear` measured here on all usable cores (every
  layout shares those cores); on GPUs the table in observe/peak_flops.py times the GPUs used;
- % of ceiling: the layout's ceiling (bench/matmul_ceiling.py: the step's own matmuls, the
  linears' and attention's (the causal half of the scores and values), the same shapes, dtype
  and counts, timed alone by every rank on its own threads at the end of the run; the slowest
  rank's) over the step's time: how much of the step is its matmuls;
- ceiling % of peak: the ceiling's own FLOP rate over the same ranks' 2048^3 matmul rate,
  timed by every rank right after its ceiling (so both see the host at the same moment):
  what the model's matmul shapes reach at best on this hardware.

Then the ratios TP / FSDP 2 and 1 process / FSDP 2 per setting. With `--profile`, each run
profiles one more step and each rank's time is printed by op group (bench/op_groups.py: matmul,
attention, communication, DTensor, copies, optimizer, elementwise, other ranges, unprofiled),
with the largest ops outside matmul and attention. A layout needing more GPUs
than the machine has is skipped. Nothing is asserted. The pipeline layouts (pp2, pp2_gpipe,
pp2_interleaved, pp2_zbv) and the context-parallel ones (cp2, cp2_block_causal, and
fsdp2_block_causal to compare with) are not in the default list; `bench/pipeline_bubble.py`
measures the pipelines' bubble. For context parallelism use a long sequence, e.g.
`--layouts fsdp2,cp2 --seq-len 2048 --local-batch-size 2`, and beyond 2048 tokens the debug
model's long flavor: `--seq-len 8192 --local-batch-size 1 -- --model.flavor debugmodel_long`.
(At the same local batch a CP 2 rank trains half the tokens per step of an FSDP 2 rank, so
per-step costs weigh twice; `cp2_fsdp_batch` and `cp2_block_causal_fsdp_batch` train CP 2 at
FSDP 2's global batch, twice the local batch, which is how one compares them at one batch.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.matmul_ceiling import rank_ceiling  # noqa: E402
from bench.op_groups import GROUPS, profile_step  # noqa: E402
from titanlite.observe.peak_flops import GPU_BF16_PEAK_FLOPS, measure_cpu_matmul_flops  # noqa: E402
from titanlite.parallel.distributed import usable_cores  # noqa: E402
from titanlite.step.precision import decide_compute_dtype  # noqa: E402

# name: (label, processes, trainer overrides). Data parallelism fills what TP leaves.
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "one": ("1 process", 1, []),
    "fsdp2": ("FSDP 2", 2, []),
    "tp2": ("TP 2", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": ("FSDP 2 x TP 2", 4, ["--parallelism.tensor_parallel_degree", "2"]),
    # Pipelines: the same local batch in microbatches of 1 sequence (8 per schedule step).
    "pp2": ("PP 2 (1F1B)", 2, ["--parallelism.pipeline_parallel_degree", "2"]),
    "pp2_gpipe": (
        "PP 2 (GPipe)",
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "GPipe"],
    ),
    "pp2_interleaved": (
        "PP 2 (Interleaved1F1B)",
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
    ),
    "pp2_zbv": (
        "PP 2 (ZBVZeroBubble)",
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
    ),
    # The sequence split over 2 ranks (each holds half of every window's tokens).
    "cp2": ("CP 2", 2, ["--parallelism.context_parallel_degree", "2"]),
    "cp2_block_causal": (
        "CP 2 (block causal)",
        2,
        ["--parallelism.context_parallel_degree", "2", "--model.attn_mask_type", "block_causal"],
    ),
    "fsdp2_block_causal": ("FSDP 2 (block causal)", 2, ["--model.attn_mask_type", "block_causal"]),
    # CP 2 at FSDP 2's global batch (twice the local batch: its one dp rank takes both of FSDP 2's).
    "cp2_fsdp_batch": ("CP 2, FSDP 2's batch", 2, ["--parallelism.context_parallel_degree", "2"]),
    "cp2_block_causal_fsdp_batch": (
        "CP 2 (block causal), FSDP 2's batch",
        2,
        ["--parallelism.context_parallel_degree", "2", "--model.attn_mask_type", "block_causal"],
    ),
}
# Layouts that train `factor` x --local-batch-size per data-parallel rank.
BATCH_FACTOR = {"cp2_fsdp_batch": 2, "cp2_block_causal_fsdp_batch": 2}
DEFAULT_LAYOUTS = ("one", "fsdp2", "tp2", "fsdp2_tp2")


@dataclass(frozen=True)
class Setting:
    name: str
    dtype: str
    compile: bool

    @property
    def overrides(self) -> list[str]:
        return ["--training.mixed_precision_param", self.dtype, "--compile.enable", str(self.compile).lower()]


@dataclass(frozen=True)
class Result:
    setting: Setting
    processes: int
    threads: int
    tokens_per_s: float
    flops_per_token: float
    memory_gib: float
    ceiling_share: float  # the step's matmuls timed alone / the step's time
    ceiling_of_peak: float  # the ceiling's FLOP/s over the ranks' 2048^3 FLOP/s, timed together
    ops: list[dict] | None = None  # each rank's profiled step by op group (--profile)


def run_worker(out_path: str, mode: str, trainer_args: list[str]) -> None:
    """One rank of one run: train, time the ceiling (not in `mode` "bare", which
    bench/torchtitan_baseline.py uses), in `mode` "profile" profile one more step
    (bench/op_groups.py); then rank 0 writes every rank's logged history."""
    import torch.distributed as dist

    from titanlite.build import plan_run
    from titanlite.config import load_config
    from titanlite.runtime.cpu_binding import bind_from_env
    from titanlite.parallel.distributed import world_from_env
    from titanlite.trainer import Trainer

    bind_from_env()  # as the trainer's command line does, before any thread of ours starts
    trainer = Trainer(plan_run(load_config(trainer_args), world_from_env()[1]))
    history = trainer.train()
    ceiling_here = rank_ceiling(trainer) if mode != "bare" else None
    ops = profile_step(trainer) if mode == "profile" else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (history, ceiling_here, ops))
    if dist.get_rank() == 0:
        summary = {
            "ranks": [h for h, _, _ in gathered],
            "ceilings": [c for _, c, _ in gathered],
            "ops": [o for _, _, o in gathered],
            "n_params": trainer.size.n_params,
            "flops_per_token": trainer.size.flops_per_token,
            "tp": trainer.plan.dims.tp,
            "device": str(trainer.device),
        }
        Path(out_path).write_text(json.dumps(summary))
    trainer.close()
    dist.destroy_process_group()


def launch(nproc: int, trainer_args: list[str], out: Path, timeout: float, cpu_bind: bool, profile: bool) -> dict:
    """Start one run with the launcher (which sets CPU threads, and binds CPU workers to
    their cores with `cpu_bind`) and return rank 0's summary."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [
        sys.executable,
        "-m",
        "titanlite.launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *(["--cpu-bind"] if cpu_bind else []),
        str(Path(__file__).resolve()),
        "--worker",
        str(out),
        "profile" if profile else "-",
        *trainer_args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(
            f"run with {nproc} processes failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def steady_tokens_per_s(summary: dict, warmup_steps: int) -> float:
    """Global tokens/s after warm-up. Each logged step is one window of the same token count,
    so a rank's harmonic mean of its `tps` is its tokens over its time; `tps` is per device
    (a TP group's tokens over its degree), so the sum over ranks counts every token once."""
    total = 0.0
    for history in summary["ranks"]:
        steady = [h["tps"] for h in history if h["step"] > warmup_steps]
        if not steady:
            raise SystemExit(f"no steps after --warmup-steps {warmup_steps}; raise --steps")
        total += statistics.harmonic_mean(steady)
    return total


def ceiling(summary: dict, warmup_steps: int) -> tuple[float, float]:
    """(share of the step, share of the peak): the slowest rank's step matmuls timed alone over
    the ranks' mean step time after warm-up (tokens per device over the harmonic-mean `tps`);
    all ranks' matmul FLOPs over that slowest time, over the ranks' summed 2048^3 rates."""
    ceilings = summary["ceilings"]
    step_s = statistics.mean(
        c["tokens_per_device"] / statistics.harmonic_mean([h["tps"] for h in history if h["step"] > warmup_steps])
        for history, c in zip(summary["ranks"], ceilings)
    )
    slowest = max(c["seconds"] for c in ceilings)
    return slowest / step_s, sum(c["flops"] for c in ceilings) / slowest / sum(c["peak_flops"] for c in ceilings)


def peak_flops(dtype: str, gpus_used: int) -> tuple[float, str]:
    """Matmul peak of `dtype` on the hardware a run uses (see the module docstring)."""
    torch_dtype = getattr(torch, dtype)
    if gpus_used:
        name = torch.cuda.get_device_name(0)
        bf16 = next((peak for key, peak in GPU_BF16_PEAK_FLOPS if key in name), float("nan"))
        return gpus_used * (bf16 if torch_dtype == torch.bfloat16 else bf16 / 2), f"{name} table x {gpus_used}"
    torch.set_num_threads(usable_cores())
    measured = measure_cpu_matmul_flops(torch_dtype, size=2048, budget_s=3.0)
    return measured, f"2048^3 F.linear on {usable_cores()} threads"


def settings_for(device: torch.device, names: list[str]) -> list[Setting]:
    """fp32, and the best setting's candidates: the dtype "auto" picks here, eager and compiled."""
    settings = [Setting("fp32", "float32", False)] if "fp32" in names else []
    if "best" in names:
        torch.set_num_threads(usable_cores())
        choice = decide_compute_dtype("auto", device)
        print(f"best setting's compute dtype: {choice.name} ({choice.reason})", file=sys.stderr)
        settings += [Setting("best eager", choice.name, False), Setting("best compiled", choice.name, True)]
    return settings


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument(
        "--warmup-steps", type=int, default=10, help="first steps left out of the averages (compile, allocator)"
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--local-batch-size", type=int, default=8, help="sequences per data-parallel rank per step")
    parser.add_argument(
        "--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}"
    )
    parser.add_argument(
        "--settings",
        default="fp32,best",
        help="comma-separated, from fp32, best (best = auto dtype, eager and compiled)",
    )
    parser.add_argument(
        "--no-cpu-bind",
        dest="cpu_bind",
        action="store_false",
        help="CPU: leave the workers unbound (default: titanlite.launch --cpu-bind, one block of cores per rank)",
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run before it counts as hung")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step per run and print each rank's step by op group (bench/op_groups.py)",
    )
    parser.add_argument("overrides", nargs="*", help="extra trainer overrides, after --")
    args = parser.parse_args()
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)} (choose from {', '.join(LAYOUTS)})")
    args.settings = [name.strip() for name in args.settings.split(",") if name.strip()]
    if not args.settings or set(args.settings) - {"fp32", "best"}:
        parser.error("--settings: choose from fp32, best")
    return args


def common_overrides(args: argparse.Namespace, batch_factor: int = 1) -> list[str]:
    return [
        "--config",
        "debug_model",
        "--training.steps",
        str(args.steps),
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        str(args.local_batch_size * batch_factor),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable_checkpoint",
        "false",
        *args.overrides,
    ]


def run_one(args: argparse.Namespace, name: str, setting: Setting, folder: Path, gpus: int) -> Result:
    """One layout in one setting."""
    label, nproc, overrides = LAYOUTS[name]
    print(f"running {label}, {setting.name} ({nproc} process(es)) ...", file=sys.stderr, flush=True)
    dump = folder / f"{name}-{setting.dtype}-{setting.compile}"
    dump.mkdir()
    trainer_args = (
        common_overrides(args, BATCH_FACTOR.get(name, 1))
        + overrides
        + setting.overrides
        + ["--job.dump_folder", str(dump)]
    )
    summary = launch(
        nproc, trainer_args, dump / "out.json", args.timeout, cpu_bind=not gpus and args.cpu_bind, profile=args.profile
    )
    memory = max(max(h["memory_gib"] for h in history) for history in summary["ranks"])
    threads = 1 if gpus else max(1, usable_cores() // nproc)
    share, of_peak = ceiling(summary, args.warmup_steps)
    return Result(
        setting,
        nproc,
        threads,
        steady_tokens_per_s(summary, args.warmup_steps),
        summary["flops_per_token"],
        memory,
        share,
        of_peak,
        summary["ops"],
    )


def run_all(args: argparse.Namespace, settings: list[Setting], gpus: int) -> dict[str, list[Result]]:
    """Every layout in every setting; a setting identical to an earlier one (best eager is
    fp32 where auto picks float32) reuses its run."""
    results: dict[str, list[Result]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.layouts:
            if gpus and LAYOUTS[name][1] > gpus:
                print(
                    f"skipping {LAYOUTS[name][0]}: needs {LAYOUTS[name][1]} GPUs, this machine has {gpus}",
                    file=sys.stderr,
                )
                continue
            runs: dict[tuple[str, bool], Result] = {}
            for setting in settings:
                key = (setting.dtype, setting.compile)
                runs[key] = (
                    dataclasses.replace(runs[key], setting=setting)
                    if key in runs
                    else run_one(args, name, setting, Path(folder), gpus)
                )
                results.setdefault(name, []).append(runs[key])
    return results


def best(runs: list[Result]) -> Result:
    """The fastest best-setting candidate (or the fp32 run when only fp32 ran)."""
    candidates = [r for r in runs if r.setting.name != "fp32"] or runs
    return max(candidates, key=lambda r: r.tokens_per_s)


def print_table(results: dict[str, list[Result]], peaks: dict[tuple[str, int], tuple[float, str]], gpus: int) -> None:
    """One row per distinct run; a run that serves two settings (best eager = fp32 where auto
    picks float32) is one row named after both."""
    print(
        "| layout | setting | processes x threads | global tokens/s | model GFLOP/s | % of matmul peak | % of ceiling "
        "| ceiling % of peak | peak memory per rank |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        winner = best(runs) if len(runs) > 1 else None
        seen: set[tuple[str, bool]] = set()
        for r in runs:
            key = (r.setting.dtype, r.setting.compile)
            if key in seen:
                continue
            seen.add(key)
            names = " = ".join(s.setting.name for s in runs if (s.setting.dtype, s.setting.compile) == key)
            mark = " (best)" if winner is not None and (winner.setting.dtype, winner.setting.compile) == key else ""
            flops = r.tokens_per_s * r.flops_per_token
            peak, _ = peaks[(r.setting.dtype, min(gpus, r.processes))]
            print(
                f"| {LAYOUTS[name][0]} | {names}{mark} | {r.processes} x {r.threads} | {r.tokens_per_s:,.0f} | "
                f"{flops / 1e9:,.1f} | {100 * flops / peak:.1f}% {r.setting.dtype} | {100 * r.ceiling_share:.1f}% | "
                f"{100 * r.ceiling_of_peak:.1f}% | {r.memory_gib:.2f} GiB |"
            )


def print_ratios(results: dict[str, list[Result]]) -> None:
    """Global tokens/s of each layout over FSDP 2's, in fp32 and in the best setting."""
    if "fsdp2" not in results:
        return
    print()
    picks = [(lambda runs: runs[0], "fp32")] if results["fsdp2"][0].setting.name == "fp32" else []
    picks += [(best, "best")] if any(r.setting.name != "fp32" for r in results["fsdp2"]) else []
    for pick, label in picks:
        base = pick(results["fsdp2"]).tokens_per_s
        ratios = [
            f"{LAYOUTS[name][0]} / FSDP 2 = {pick(runs).tokens_per_s / base:.2f}"
            for name, runs in results.items()
            if name != "fsdp2"
        ]
        print(f"{label}: " + "; ".join(ratios))


def print_op_groups(results: dict[str, list[Result]]) -> None:
    """Each rank's profiled step per layout and setting: each op group's share of the step,
    and the largest ops outside matmuls and attention (what item 4 of issue 31 removes from)."""
    print(
        "\nprofiled step (one step after the timed ones; the profiler adds its own cost per op), share by op group:\n"
    )
    print("| layout | setting | rank | step | " + " | ".join(GROUPS) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(GROUPS))
    for name, runs in results.items():
        for r in runs:
            for rank, ops in enumerate(r.ops):
                wall, groups = ops["wall"], ops["groups"]
                print(
                    f"| {LAYOUTS[name][0]} | {r.setting.name} | {rank} | {wall * 1000:,.0f} ms | "
                    + " | ".join(f"{100 * groups[g] / wall:.1f}%" for g in GROUPS)
                    + " |"
                )
    print("\nlargest ops outside matmul and attention (ms of the profiled step):\n")
    for name, runs in results.items():
        for r in runs:
            for rank, ops in enumerate(r.ops):
                top = ", ".join(f"{op} {seconds * 1000:,.0f}" for op, seconds in ops["top"][:8])
                print(f"- {LAYOUTS[name][0]}, {r.setting.name}, rank {rank}: {top}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    args = parse_args()
    gpus = torch.cuda.device_count()
    device = torch.device("cuda" if gpus else "cpu")
    settings = settings_for(device, args.settings)
    results = run_all(args, settings, gpus)
    if not results:
        raise SystemExit("no layout ran")
    peaks = {(s.dtype, min(gpus, LAYOUTS[name][1])): None for name in results for s in settings}
    peaks = {key: peak_flops(key[0], key[1]) for key in peaks}
    where = torch.cuda.get_device_name(0) if gpus else f"CPU, {usable_cores()} cores"
    print(
        f"debug model, seq_len {args.seq_len}, local batch {args.local_batch_size} per data-parallel rank, "
        f"{args.steps} steps "
        f"(first {args.warmup_steps} left out); {where}; torch {torch.__version__}"
    )
    print(
        "matmul peaks: "
        + "; ".join(f"{dtype} {peak / 1e9:,.0f} GFLOP/s ({source})" for (dtype, _), (peak, source) in peaks.items())
    )
    print()
    print_table(results, peaks, gpus)
    print_ratios(results)
    if args.profile:
        print_op_groups(results)


if __name__ == "__main__":
    main()
