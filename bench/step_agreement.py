"""What the per-step agreement (`step/agreement.agree_on_step`: stop requested, loss and grad norm
finite) costs, next to the one scalar all-reduce every step already pays (the grad norm's).

    python bench/step_agreement.py [--nproc 2] [--iterations 2000]

Runs itself under `python -m titanlite.launch --standalone` (gloo on CPU, NCCL on GPUs) and
prints microseconds per call of each and their ratio, from rank 0. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def _per_call_us(calls: list, iterations: int) -> list[float]:
    """Microseconds per call of each function, measured in alternation so that a change in
    the machine's load hits both alike."""
    spent = [0.0] * len(calls)
    for round_ in range(iterations + 20):  # the first 20 warm up connections and kernels
        for index, fn in enumerate(calls):
            start = time.perf_counter()
            fn()
            if round_ >= 20:
                spent[index] += time.perf_counter() - start
    return [total / iterations * 1e6 for total in spent]


def worker(iterations: int) -> None:
    from titanlite.step.agreement import agree_on_step
    from titanlite.parallel.distributed import init_distributed, shutdown

    info = init_distributed(300)
    loss = torch.tensor(2.5, device=info.device)
    norm = torch.tensor(1.0, device=info.device)

    def grad_norm_all_reduce() -> float:
        total = norm.clone()
        dist.all_reduce(total)
        return total.item()

    baseline, agreement = _per_call_us([grad_norm_all_reduce, lambda: agree_on_step(0, loss, norm)], iterations)
    if info.rank == 0:
        print(f"{info.world_size} processes, {info.device.type}, {iterations} calls each")
        print(f"grad-norm scalar all-reduce + item: {baseline:8.1f} us/step")
        print(f"agree_on_step (3 flags, MAX):       {agreement:8.1f} us/step  (ratio {agreement / baseline:.2f})")
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.iterations)
        return
    command = [
        sys.executable,
        "-m",
        "titanlite.launch",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        "--iterations",
        str(args.iterations),
    ]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    sys.exit(subprocess.run(command, cwd=REPO, env=env).returncode)


if __name__ == "__main__":
    main()
