"""Peak memory per rank, tokens/s and page faults per step of CPU training under glibc malloc settings, in one run.

    python bench/allocator.py [--models moe,dense] [--layouts one,fsdp2] [--settings launcher,before,glibc]
                              [--steps 8] [--warmup-steps 4] [--rounds 1] [--setting NAME=VAR=V,VAR=V ...]
                              [--moe-layers 8] [--malloc-trim] [-- extra trainer overrides]

Why: issue 36 item 1. `titanlite.launch` sets glibc malloc's settings for CPU workers
(titanlite/launch/__init__.py, `CPU_MALLOC_DEFAULTS`) so that a step's freed tensors are reused
instead of being mapped and zeroed again; the settings must not cost memory in return.
Each (model, layout, setting) is one real `titanlite.launch --standalone` run of the trainer
(gloo, float32, eager, no checkpoint), the settings put in the launcher's environment
(which it hands on where the caller set them). Settings:

- launcher: nothing set, what `titanlite.launch` gives a CPU worker now;
- before: what it gave before issue 36 (`MALLOC_MMAP_MAX_=0`, `MALLOC_TRIM_THRESHOLD_=1 TiB`, no huge pages);
- glibc: glibc's own values set explicitly, as the issue ran it (`MALLOC_MMAP_MAX_=65536
  MALLOC_TRIM_THRESHOLD_=131072`; setting either also fixes glibc's mmap threshold at 128 KiB);
- `--setting NAME=VAR=V,VAR=V` adds one of your own (`--setting none=` sets nothing and runs
  glibc's adaptive defaults, which the launcher does not give).

`--malloc-trim`: each worker also calls glibc's `malloc_trim(0)` after every step, which
returns the free pages inside the heap (a trim threshold returns only its top).

Models:

- moe: torchtitan's Qwen3 `debugmodel_moe` shape (torchtitan models/qwen3/__init__.py: dim
  256, 8 layers, 16 heads / 8 kv heads of 128, 64 experts of width 768, top 8, softmax,
  renormalized, no shared expert): the `torchtitan:debugmodel_moe` flavor, with the bundled tokenizer's
  vocabulary (4096; torchtitan's test tokenizer has 2048), local batch 4 x 256 per rank
  (`--moe-layers N` keeps N of its blocks: the full shape needs 4-8 GiB per FSDP 2 rank);
- dense: titanlite's Llama debug model, local batch 8 x 512 per rank (docs/performance.md).

Figures per run, after `--warmup-steps`: each rank's peak resident memory (VmHWM, the
whole process: what `top` shows at its worst), global tokens/s (as bench/throughput.py:
all data-parallel ranks' tokens per second of wall time) and rank 0's minor page faults
per step. `--rounds` repeats the whole sweep, settings interleaved within each round, so
speed ratios compare runs minutes apart, not hours. Runs are one after another: a MoE FSDP 2
run of the torchtitan shape holds 4-8 GiB per rank. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

MOE_FLAVOR = "torchtitan_debugmodel_moe"
MOE_LAYERS_ENV = "TITANLITE_BENCH_MOE_LAYERS"  # --moe-layers, to the workers
MALLOC_TRIM_ENV = "TITANLITE_BENCH_MALLOC_TRIM"  # --malloc-trim, to the workers

# The launcher adds glibc.malloc.hugetlb=1 unless the caller's GLIBC_TUNABLES names it.
NO_HUGE_PAGES = "glibc.malloc.hugetlb=0"
SETTINGS: dict[str, dict[str, str]] = {
    "launcher": {},
    "before": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "GLIBC_TUNABLES": NO_HUGE_PAGES},
    "glibc": {"MALLOC_MMAP_MAX_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072", "GLIBC_TUNABLES": NO_HUGE_PAGES},
}

# name: (trainer overrides, label)
MODELS: dict[str, tuple[list[str], str]] = {
    "moe": (
        [
            "--model.name",
            "qwen3",
            "--model.flavor",
            MOE_FLAVOR,
            "--training.local_batch_size",
            "4",
            "--training.seq_len",
            "256",
        ],
        "Qwen3-MoE, torchtitan debugmodel_moe shape (64 experts, top 8), 4 x 256",
    ),
    "dense": (
        ["--training.local_batch_size", "8", "--training.seq_len", "512"],
        "Llama debug model, 8 x 512",
    ),
}
LAYOUTS = {"one": ("1 process", 1), "fsdp2": ("FSDP 2", 2)}


def register_moe_flavor() -> None:
    """torchtitan's Qwen3 `debugmodel_moe` shape (the `torchtitan:debugmodel_moe` flavor) as a
    flavor of this process, with `--moe-layers` blocks (8 unless the bench was told otherwise)."""
    from titanlite.models.qwen3 import qwen3_spec, qwen3_torchtitan_flavors

    qwen3_spec.flavors[MOE_FLAVOR] = dataclasses.replace(
        qwen3_torchtitan_flavors["debugmodel_moe"], n_layers=int(os.environ.get(MOE_LAYERS_ENV, "8"))
    )


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def free_in_heap() -> int:
    """Bytes glibc malloc holds free in its arenas (mallinfo2's fordblks, all arenas): what a
    setting keeps for reuse after the run's last step."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2().fordblks


def run_worker(out_path: str, trainer_args: list[str]) -> None:
    """One rank: train with each step's page faults counted; rank 0 writes every rank's figures."""
    import torch.distributed as dist

    from titanlite.build import plan_run
    from titanlite.config import load_config
    from titanlite.parallel.distributed import world_from_env
    from titanlite.trainer import Trainer

    register_moe_flavor()
    trainer = Trainer(plan_run(load_config(trainer_args), world_from_env()[1]))
    faults: list[int] = []
    step = trainer.train_step

    def counted_step(microbatches):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = step(microbatches)
        if os.environ.get(MALLOC_TRIM_ENV) == "1":
            ctypes.CDLL(None).malloc_trim(0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return result

    trainer.train_step = counted_step
    history = trainer.train()
    with open("/proc/self/status") as status:
        peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    kept = {"peak_bytes": peak_kib * 1024, "free_in_heap_bytes": free_in_heap()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"history": history, "faults": faults, **kept})
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(gathered))
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


def launch(nproc: int, env_extra: dict[str, str], trainer_args: list[str], out: Path, timeout: float) -> list[dict]:
    """One run under `titanlite.launch`, the setting's variables in its environment (and
    every malloc variable and glibc tunable of ours removed, so only the setting's reach the
    launcher)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | env_extra
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    cmd = [
        sys.executable,
        "-m",
        "titanlite.launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        str(out),
        *trainer_args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def figures(ranks: list[dict], warmup: int) -> dict[str, object]:
    """Peak GiB per rank, global tokens/s (sum of the ranks' harmonic-mean `tps`), rank 0's
    mean page faults per step, all after `warmup` steps."""
    return {
        "peaks": [r["peak_bytes"] / 2**30 for r in ranks],
        "tokens_per_s": sum(
            statistics.harmonic_mean([h["tps"] for h in r["history"] if h["step"] > warmup]) for r in ranks
        ),
        "faults": statistics.mean(ranks[0]["faults"][warmup:]),
        "free_in_heap": ranks[0]["free_in_heap_bytes"] / 2**30,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="moe,dense", help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--layouts", default="one,fsdp2", help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--settings", default="launcher,before,glibc", help="comma-separated setting names")
    parser.add_argument(
        "--setting", action="append", default=[], metavar="NAME=VAR=V,...", help="add a setting of your own"
    )
    parser.add_argument("--moe-layers", type=int, default=8, help="blocks of the MoE model (torchtitan's: 8)")
    parser.add_argument(
        "--malloc-trim",
        action="store_true",
        help="workers call glibc's malloc_trim(0) after each step (returns free pages inside the heap)",
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="sweeps, settings interleaved in each")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run before it counts as hung")
    parser.add_argument("overrides", nargs="*", help="extra trainer overrides, after --")
    args = parser.parse_args()
    for item in args.setting:
        name, _, variables = item.partition("=")
        SETTINGS[name] = dict(pair.split("=", 1) for pair in variables.split(",") if pair)
    args.models, args.layouts, args.settings = (
        [n.strip() for n in value.split(",") if n.strip()] for value in (args.models, args.layouts, args.settings)
    )
    for kind, names, known in (("models", args.models, MODELS), ("layouts", args.layouts, LAYOUTS)):
        if set(names) - set(known):
            parser.error(f"--{kind}: choose from {', '.join(known)}")
    if set(args.settings) - set(SETTINGS):
        parser.error(f"--settings: choose from {', '.join(SETTINGS)} (or add one with --setting)")
    return args


def trainer_args(args: argparse.Namespace, model: str, dump: Path) -> list[str]:
    return [
        "--config",
        "debug_model",
        *MODELS[model][0],
        "--training.steps",
        str(args.steps),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable_checkpoint",
        "false",
        "--job.dump_folder",
        str(dump),
        *args.overrides,
    ]


def main() -> None:
    args = parse_args()
    os.environ[MOE_LAYERS_ENV] = str(args.moe_layers)
    os.environ[MALLOC_TRIM_ENV] = "1" if args.malloc_trim else "0"
    trims = ", malloc_trim(0) after each" if args.malloc_trim else ""
    print(
        f"{args.steps} steps{trims}, {args.warmup_steps} warm-up; float32, eager, gloo; settings: "
        + "; ".join(
            f"{name}: {' '.join(f'{k}={v}' for k, v in SETTINGS[name].items()) or '-'}" for name in args.settings
        )
    )
    print(
        "\n| model | layout | setting | peak GiB per rank | tokens/s | page faults per step, rank 0 "
        "| malloc's free bytes at end, GiB, rank 0 |"
    )
    print("|---|---|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for model in args.models:
                for layout in args.layouts:
                    for setting in args.settings:
                        dump = Path(tmp) / f"{round_}-{model}-{layout}-{setting}"
                        dump.mkdir()
                        ranks = launch(
                            LAYOUTS[layout][1],
                            SETTINGS[setting],
                            trainer_args(args, model, dump),
                            dump / "out.json",
                            args.timeout,
                        )
                        got = figures(ranks, args.warmup_steps)
                        peaks = " / ".join(f"{p:.2f}" for p in got["peaks"])
                        print(
                            f"| {model} | {LAYOUTS[layout][0]} | {setting} | {peaks} | {got['tokens_per_s']:,.0f} | "
                            f"{got['faults']:,.0f} | {got['free_in_heap']:.2f} |",
                            flush=True,
                        )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2], sys.argv[3:])
    else:
        main()
