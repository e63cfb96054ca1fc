"""The pipeline bubble, measured: the share of a schedule step each rank spends not computing.

    python bench/pipeline_bubble.py [--microbatches 2,4,8,16] [--schedules 1F1B,GPipe] [--steps 8]
                                    [--seq-len 256] [--n-layers 7] [--balance flops] [--timeout 600]

Each (schedule, microbatches) is a real 2-rank run of the trainer on the debug model (pp 2, gloo
on CPU, each rank bound to its own core by `titanlite.launch --cpu-bind`), one sequence per
microbatch. The debug model's shapes with 7 blocks by default (`--n-layers`; the flavor has 6):
its output head costs about one block, so 6 blocks cannot split evenly into two stages around it
and the measured idle would be mostly the stages' imbalance, not the schedule's cost; 7 split 4
| 3 + head. `--balance` is `parallelism.pipeline_parallel_balance`. In every rank the stage's
compute (torch's `PipelineStage` forward, backward and weight-gradient chunks) is timed; the
rest of the schedule step's wall time is the bubble plus the time spent moving activations.
Printed per run, averaged over the steps after the first two and over the ranks:

    measured idle = 1 - compute time / schedule-step time

next to the bubble of the textbook schedule, (p - 1) / (m + p - 1) for 1F1B and GPipe (p
stages, m microbatches). The measured figure includes the sends and receives, so it sits
above the textbook one by their cost; both fall as m grows. The textbook assumes equal
stages; the last column is the bubble of the stages as measured (each rank's compute per
step, printed): the slowest stage paces m - 1 microbatches and each runs one more in the fill
and the drain, (m - 1) t_max + sum t_i. What the measured idle has above that column is the
schedule's own cost (sends, receives, bookkeeping). `--split-points` moves the stage boundary.
Nothing is asserted.
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


def time_stage_compute() -> list[float]:
    """Wrap the stage's compute chunks with a clock; returns the list the seconds go into."""
    from torch.distributed.pipelining import stage

    spent: list[float] = [0.0]
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        original = getattr(stage._PipelineStageBase, name)

        def timed(self, *args, __original=original, **kwargs):
            start = time.perf_counter()
            try:
                return __original(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(stage._PipelineStageBase, name, timed)
    return spent


BENCH_FLAVOR = "debugmodel_bench"


def register_bench_flavor(n_layers: int) -> None:
    """The debug model's shapes with `n_layers` blocks, as the Llama flavor BENCH_FLAVOR."""
    import dataclasses

    from titanlite.models.llama import llama3_flavors

    llama3_flavors[BENCH_FLAVOR] = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=n_layers)


def describe_split(trainer_args: list[str], n_layers: int) -> str:
    """The stages the trainer will build, planned here without a device."""
    from titanlite.build import plan_run
    from titanlite.config import load_config

    register_bench_flavor(n_layers)
    return (
        plan_run(load_config([*trainer_args, "--model.flavor", BENCH_FLAVOR]), DEGREE)
        .pipeline.describe()
        .split("; ", 1)[1]
    )


def run_worker(out_path: str, n_layers: int, trainer_args: list[str]) -> None:
    """One rank: train step by step, recording the compute and wall time of each step, on the
    debug model's shapes with `n_layers` blocks."""
    import torch.distributed as dist

    from titanlite.build import plan_run
    from titanlite.config import load_config
    from titanlite.parallel.distributed import world_from_env
    from titanlite.runtime.cpu_binding import bind_from_env
    from titanlite.trainer import Trainer

    bind_from_env()
    register_bench_flavor(n_layers)
    spent = time_stage_compute()
    trainer = Trainer(plan_run(load_config([*trainer_args, "--model.flavor", BENCH_FLAVOR]), world_from_env()[1]))
    batches, steps = iter(trainer.data), []
    for step in range(1, trainer.cfg.training.steps + 1):
        trainer.state.step = step
        microbatches = [next(batches) for _ in range(trainer.plan.grad_accum_steps)]
        dist.barrier()
        spent[0], start = 0.0, time.perf_counter()
        trainer.forward_backward.train(microbatches, step)
        wall = time.perf_counter() - start
        steps.append({"wall": wall, "compute": spent[0]})
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, steps)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(gathered))
    trainer.close()
    dist.destroy_process_group()


def launch(n_layers: int, trainer_args: list[str], out: Path, timeout: float) -> list[list[dict]]:
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
        str(n_layers),
        *trainer_args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", default="2,4,8,16")
    parser.add_argument("--schedules", default="1F1B,GPipe")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--n-layers", type=int, default=7, help="blocks of the debug model's shapes (the flavor has 6)")
    parser.add_argument(
        "--balance", default="flops", choices=("layers", "flops"), help="parallelism.pipeline_parallel_balance"
    )
    parser.add_argument(
        "--split-points", default="", help="parallelism.pipeline_parallel_split_points (instead of --balance)"
    )
    args = parser.parse_args()
    print(
        f"debug model's shapes with {args.n_layers} blocks, pp {DEGREE}, seq_len {args.seq_len}, 1 sequence per "
        "microbatch, "
        f"{args.steps} steps (first 2 left out)"
    )
    header = (
        "| schedule | microbatches | step time | compute per rank | compute share | measured idle | textbook bubble "
        "(p-1)/(m+p-1) "
        "| bubble of these stages |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    printed_split = False
    with tempfile.TemporaryDirectory() as folder:
        for schedule in args.schedules.split(","):
            for m in (int(x) for x in args.microbatches.split(",")):
                dump = Path(folder) / f"{schedule}-{m}"
                trainer_args = [
                    "--config",
                    "debug_model",
                    "--training.steps",
                    str(args.steps),
                    "--training.seq_len",
                    str(args.seq_len),
                    "--training.local_batch_size",
                    str(m),
                    "--training.mixed_precision_param",
                    "float32",
                    "--parallelism.pipeline_parallel_degree",
                    str(DEGREE),
                    "--parallelism.pipeline_parallel_schedule",
                    schedule,
                    "--metrics.enable_tensorboard",
                    "false",
                    "--metrics.peak_flops",
                    "1e11",
                    "--job.dump_folder",
                    str(dump),
                    *(
                        ["--parallelism.pipeline_parallel_split_points", args.split_points]
                        if args.split_points
                        else ["--parallelism.pipeline_parallel_balance", args.balance]
                    ),
                ]
                if not printed_split:
                    print(f"split: {describe_split(trainer_args, args.n_layers)}\n")
                    print(header)
                    printed_split = True
                ranks = launch(args.n_layers, trainer_args, dump.with_suffix(".json"), args.timeout)
                steady = [s for rank in ranks for s in rank[2:]]
                wall = statistics.mean(s["wall"] for s in steady)
                compute = statistics.mean(s["compute"] / s["wall"] for s in steady)
                textbook = (DEGREE - 1) / (m + DEGREE - 1)
                per_rank = [statistics.mean(s["compute"] for s in rank[2:]) for rank in ranks]
                # The schedule at these stages' own speeds: the slowest stage paces m - 1 microbatches
                # and every stage runs one in the fill and the drain, (m - 1) t_max + sum t_i
                # (the textbook's (m + p - 1) t when the stages are equal).
                ideal = ((m - 1) * max(per_rank) + sum(per_rank)) / m
                balanced = 1 - statistics.mean(per_rank) / ideal
                stages = " / ".join(f"{c * 1000:,.0f}" for c in per_rank)
                print(
                    f"| {schedule} | {m} | {wall * 1000:,.0f} ms | {stages} ms | {compute:.1%} | {1 - compute:.1%} | "
                    f"{textbook:.1%} "
                    f"| {balanced:.1%} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
