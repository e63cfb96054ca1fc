"""Training throughput, MFU and peak memory per parallel layout, measured by the trainer itself.

    python bench/throughput.py [--steps 10] [--warmup-steps 3] [--seq-len 256] [--local-batch-size 4]
                               [--dtype float32|bfloat16] [--layouts one,fsdp2,tp2,fsdp2_tp2]
                               [-- extra trainer overrides, e.g. --metrics.peak_flops 1e12]

Each layout is a real run of `titanlite.train`'s Trainer under `python -m titanlite.launch
--standalone` (gloo on CPU, NCCL on GPUs) on the debug model, with the same local batch per
data-parallel rank. The figures are the ones the trainer logs every step
(titanlite/metrics.py), averaged over the steps after `--warmup-steps`:

- tokens/s per rank: the trainer's `tps`, tokens per second per device (a TP group's
  tokens divided by its degree), averaged over ranks; the ratio column divides it by the
  1-process figure. On a CPU box all processes share the same cores (OMP_NUM_THREADS is set
  to cores / processes), so a ratio of 1 / processes already means the same total rate;
  on GPUs each rank has its own device and 1 is the ideal.
- MFU: the trainer's, against its peak (on CPU a matmul measured at start-up on each
  rank's own threads; on GPUs the table in metrics.py).
- peak memory per rank: the largest over ranks of the trainer's figure (CPU: peak
  resident set of the process, torch included; CUDA: peak reserved by the allocator).

A layout needing more GPUs than `torch.cuda.device_count()` is skipped (a 1-GPU machine
runs only the 1-process layout). Prints a Markdown table; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# name: (label, processes, trainer overrides). Data parallelism fills what TP leaves.
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "one": ("1 process", 1, []),
    "fsdp2": ("FSDP 2", 2, []),
    "tp2": ("TP 2", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": ("FSDP 2 x TP 2", 4, ["--parallelism.tensor_parallel_degree", "2"]),
}


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_worker(out_path: str, trainer_args: list[str]) -> None:
    """One rank of one layout: train, then rank 0 writes every rank's logged history."""
    import torch.distributed as dist

    from titanlite.config import load_config
    from titanlite.parallel.distributed import world_from_env
    from titanlite.build import plan_run
    from titanlite.train import Trainer

    cfg = load_config(trainer_args)
    trainer = Trainer(plan_run(cfg, world_from_env()[1]))
    history = trainer.train()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, history)
    if dist.get_rank() == 0:
        peak = trainer.metrics.peak
        summary = {"ranks": gathered, "n_params": trainer.size.n_params, "peak_flops": peak.flops, "peak_source": peak.source, "device": str(trainer.device)}
        Path(out_path).write_text(json.dumps(summary))
    trainer.close()
    dist.destroy_process_group()


def launch_layout(nproc: int, threads: int, trainer_args: list[str], out: Path, timeout: float) -> dict:
    """Start one layout with the launcher and return rank 0's summary; on failure, show its output."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "titanlite.launch", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), "--worker", str(out), *trainer_args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"layout with {nproc} processes failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def steady_state(summary: dict, warmup_steps: int) -> dict:
    """Average the per-step figures after warm-up. Each step is one logging window of the
    same token count, so the harmonic mean of tps (and of MFU, proportional to it) is
    total tokens over total time."""
    per_rank_tps, per_rank_mfu, memory = [], [], []
    for history in summary["ranks"]:
        steady = [h for h in history if h["step"] > warmup_steps]
        if not steady:
            raise SystemExit(f"no steps after --warmup-steps {warmup_steps}; raise --steps")
        per_rank_tps.append(statistics.harmonic_mean([h["tps"] for h in steady]))
        if all("mfu" in h for h in steady):
            per_rank_mfu.append(statistics.harmonic_mean([h["mfu"] for h in steady]))
        memory.append(max(h["memory_gib"] for h in history))
    return {
        "tps": statistics.mean(per_rank_tps),
        "mfu": statistics.mean(per_rank_mfu) if per_rank_mfu else float("nan"),
        "memory_gib": max(memory),
        "peak_gflops": (summary["peak_flops"] or float("nan")) / 1e9,
        "peak_source": summary["peak_source"],
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps per layout")
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the averages")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--local-batch-size", type=int, default=4, help="sequences per data-parallel rank per step")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="training.mixed_precision_param (FSDP mixed precision, or autocast without FSDP)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per layout before it counts as hung")
    parser.add_argument("overrides", nargs="*", help="extra trainer overrides, after --")
    args = parser.parse_args()
    names = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in names if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)} (choose from {', '.join(LAYOUTS)})")

    gpus = torch.cuda.device_count()
    cores = usable_cores()
    common = [
        "--config", "debug_model",
        "--training.steps", str(args.steps),
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.local_batch_size),
        "--training.mixed_precision_param", args.dtype,
        "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable_checkpoint", "false",
        *args.overrides,
    ]  # fmt: skip

    results: dict[str, tuple[int, int, dict]] = {}
    first_summary = None
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            label, nproc, overrides = LAYOUTS[name]
            if gpus and nproc > gpus:
                print(f"skipping {label}: needs {nproc} GPUs, this machine has {gpus}", file=sys.stderr)
                continue
            threads = max(1, cores // nproc)
            print(f"running {label} ({nproc} process(es) x {threads} thread(s)) ...", file=sys.stderr, flush=True)
            dump = Path(folder, name)
            dump.mkdir()
            summary = launch_layout(nproc, threads, common + overrides + ["--job.dump_folder", str(dump)], dump / "out.json", args.timeout)
            first_summary = first_summary or summary
            results[name] = (nproc, threads, steady_state(summary, args.warmup_steps))

    if not results:
        raise SystemExit("no layout ran")
    device = first_summary["device"]
    where = torch.cuda.get_device_name(0) if gpus else f"CPU, {cores} cores"
    print(f"debug model ({first_summary['n_params'] / 1e6:.1f} M parameters), seq_len {args.seq_len}, local batch {args.local_batch_size}, "
          f"{args.dtype}, {args.steps} steps (first {args.warmup_steps} left out); {device} ({where}); torch {torch.__version__}")
    sources: dict[str, list[str]] = {}
    for name, (_, _, figures) in results.items():
        sources.setdefault(figures["peak_source"], []).append(LAYOUTS[name][0])
    print("MFU peak (rank 0's): " + "; ".join(f"{source} ({', '.join(labels)})" for source, labels in sources.items()))
    print()
    print("| layout | processes x threads | tokens/s per rank | vs 1 process | MFU | MFU peak per rank | peak memory per rank |")
    print("|---|---|---:|---:|---:|---:|---:|")
    baseline = results["one"][2]["tps"] if "one" in results else None
    for name, (nproc, threads, figures) in results.items():
        ratio = f"{figures['tps'] / baseline:.2f}" if baseline else "n/a"
        print(f"| {LAYOUTS[name][0]} | {nproc} x {threads} | {figures['tps']:,.0f} | {ratio} | {figures['mfu']:.3g}% | "
              f"{figures['peak_gflops']:,.0f} GFLOP/s | {figures['memory_gib']:.2f} GiB |")


if __name__ == "__main__":
    main()
