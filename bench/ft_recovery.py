"""What fault tolerance costs: the time from a replica group's kill -9 to the survivor's next
step, the time a restarted group takes to heal, and the per-step overhead of two replica groups
on torchft against plain HSDP of the same layout and global batch (a ratio of step times).

    python bench/ft_recovery.py [--steps 40] [--kill-at 10] [--procs 2]

Two groups of `--procs` FSDP ranks (the debug model, fp32, seq_len 64, local batch 2) and a
lighthouse (heartbeat timeout 1 s), then HSDP `2 x procs` on one world. Step times are the
median over steps after the first five of tokens per device / tps (the trainer's own figure);
the kill-to-step time is measured here, from the SIGKILL to the survivor's next step line.
Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from tests.helpers.distributed import EQUIVALENCE_ARGS, run_trainer_worker, with_overrides  # noqa: E402
from tests.helpers.replica_groups import Group, lighthouse  # noqa: E402

TOKENS_PER_DEVICE = 2 * 64  # local batch x seq_len


def step_seconds(history: list[dict]) -> float:
    return statistics.median(TOKENS_PER_DEVICE / h["tps"] for h in history[5:])


def next_step_after(group: Group, step: int, timeout: float = 300) -> float:
    """Poll the group's rank-0 log until a step line after `step` appears; returns that time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [int(s) for s in re.findall(r"^\S+ step +(\d+) ", group.logs[0].read_text(), re.MULTILINE)]
        if steps and steps[-1] > step:
            return time.monotonic()
        time.sleep(0.01)
    raise SystemExit(f"the survivor logged no step after {step} within {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--procs", type=int, default=2)
    opts = parser.parse_args()
    base = with_overrides(EQUIVALENCE_ARGS, ["--training.local_batch_size", "2", "--training.steps", str(opts.steps)])
    ft = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]
    with TemporaryDirectory(prefix="ft-bench-") as folder:
        tmp = Path(folder)
        with lighthouse(min_replicas=2) as address:
            steady_args = [*base, *ft, "--job.dump_folder", str(tmp / "a")]
            groups = [Group(g, opts.procs, steady_args, tmp, address) for g in (0, 1)]
            steady = [group.wait(600) for group in groups]
        with lighthouse(min_replicas=1) as address:
            args = [*base, *ft, "--job.dump_folder", str(tmp / "b")]
            survivor, victim = (Group(g, opts.procs, args, tmp, address, tag="_kill") for g in (0, 1))
            survivor.wait_for(rf"^\S+ step +{opts.kill_at} ", 300)
            last = max(int(s) for s in re.findall(r"^\S+ step +(\d+) ", survivor.logs[0].read_text(), re.MULTILINE))
            killed = victim.kill()
            to_next_step = next_step_after(survivor, last) - killed
            restarted_at = time.monotonic()
            rejoined = Group(1, opts.procs, args, tmp, address, tag="_rejoined")
            healed = rejoined.wait_for(r"healed from a live group", 300)
            to_heal = time.monotonic() - restarted_at
            survivor.wait(600), rejoined.wait(600)
        hsdp = run_trainer_worker(
            2 * opts.procs,
            [*base, "--parallelism.data_parallel_replicate_degree", "2", "--job.dump_folder", str(tmp / "hsdp")],
            tmp / "hsdp.json",
            timeout=600,
        )
    ft_step, hsdp_step = step_seconds(steady[0]["history"]), step_seconds(hsdp["history"])
    print(f"two replica groups of FSDP {opts.procs} on torchft vs HSDP 2 x {opts.procs}, {opts.steps} steps")
    print(f"step time: ft {ft_step * 1000:.0f} ms, HSDP {hsdp_step * 1000:.0f} ms, ratio {ft_step / hsdp_step:.2f}")
    print(f"kill -9 of group 1 after step {last}: the survivor's next step {to_next_step:.2f} s later")
    print(f"group 1 started again: healed {to_heal:.1f} s after its start ({healed[0]!r})")


if __name__ == "__main__":
    main()
