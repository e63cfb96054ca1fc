"""The optimizer step's share of the training step, Muon against AdamW, at FSDP 2.

    python bench/optim_step.py [--steps 8] [--seq-len 256] [--batch 2] [--flavor debugmodel]
                               [--optimizers AdamW,Muon] [--timeout 600]

Each optimizer is a real 2-rank run of the trainer (FSDP 2, gloo on CPU, each rank bound to
its own core by `titanlite.launch --cpu-bind`), fp32. In every rank the whole training step
(`Trainer.train_step`: forward, backward, clipping, the step agreement, the optimizer step) and
the optimizer step inside it are timed; printed per optimizer, averaged over the steps after
the first two and over the ranks: both times and the optimizer's share of the step; then the
ratio of Muon's optimizer step to AdamW's. Muon's step includes its two all-to-alls (each
matrix's blocks to its owner and back) and the Newton-Schulz iterations of the matrices this
rank owns. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

DEGREE = 2


def run_worker(out_path: str, trainer_args: list[str]) -> None:
    """One rank: train step by step, timing each whole step and the optimizer step in it."""
    import torch.distributed as dist

    from titanlite.build import plan_run
    from titanlite.config import load_config
    from titanlite.parallel.distributed import world_from_env
    from titanlite.runtime.cpu_binding import bind_from_env
    from titanlite.trainer import Trainer

    bind_from_env()
    trainer = Trainer(plan_run(load_config(trainer_args), world_from_env()[1]))
    spent = [0.0]
    optimizer_step = trainer.optimizer.step

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        try:
            return optimizer_step(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    trainer.optimizer.step = timed_step
    batches, steps = iter(trainer.data), []
    for step in range(1, trainer.cfg.training.steps + 1):
        trainer.state.step = step
        microbatches = [next(batches) for _ in range(trainer.plan.grad_accum_steps)]
        dist.barrier()
        spent[0], start = 0.0, time.perf_counter()
        trainer.train_step(microbatches)
        steps.append({"wall": time.perf_counter() - start, "optimizer": spent[0]})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, steps)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(gathered))
    trainer.close()
    dist.destroy_process_group()


def launch(trainer_args: list[str], out: Path, timeout: float) -> list[list[dict]]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [
        sys.executable,
        "-m",
        "titanlite.launch",
        "--standalone",
        f"--nproc-per-node={DEGREE}",
        "--cpu-bind",
        str(Path(__file__).resolve()),
        "--worker",
        str(out),
        *trainer_args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--optimizers", default="AdamW,Muon")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    print(
        f"llama3 {args.flavor}, FSDP {DEGREE}, fp32, seq_len {args.seq_len}, {args.batch} sequences per rank, "
        f"{args.steps} steps (first 2 left out)\n"
    )
    print("| optimizer | step time | optimizer step | optimizer share |\n|---|---:|---:|---:|")
    optimizer_ms = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.optimizers.split(","):
            dump = Path(folder) / name
            trainer_args = [
                "--config",
                "debug_model",
                "--model.flavor",
                args.flavor,
                "--optimizer.name",
                name,
                "--training.steps",
                str(args.steps),
                "--training.seq_len",
                str(args.seq_len),
                "--training.local_batch_size",
                str(args.batch),
                "--training.mixed_precision_param",
                "float32",
                "--metrics.enable_tensorboard",
                "false",
                "--metrics.peak_flops",
                "1e11",
                "--job.dump_folder",
                str(dump),
            ]
            steady = [s for rank in launch(trainer_args, dump.with_suffix(".json"), args.timeout) for s in rank[2:]]
            wall = statistics.mean(s["wall"] for s in steady)
            optimizer_ms[name] = statistics.mean(s["optimizer"] for s in steady) * 1000
            share = statistics.mean(s["optimizer"] / s["wall"] for s in steady)
            print(f"| {name} | {wall * 1000:,.1f} ms | {optimizer_ms[name]:,.1f} ms | {share:.1%} |", flush=True)
    if {"AdamW", "Muon"} <= optimizer_ms.keys():
        print(f"\nMuon's optimizer step / AdamW's: {optimizer_ms['Muon'] / optimizer_ms['AdamW']:.1f}x")


if __name__ == "__main__":
    main()
