"""Expert parallelism against FSDP alone on an MoE debug model: throughput and per-rank memory at
ep 1 (FSDP 2) against ep 2, on the same 2 gloo processes, with where each step's time goes.

    python bench/moe_ep.py [--model qwen3:debugmodel_moe] [--steps 6] [--seq-len 256] [--batch 4]
                           [--threads 1]

`--model deepseek_v3:torchtitan:debugmodel` is DeepSeek-V3's debug shape as torchtitan has it
(issue 50: 8 experts top-3 + 2 shared, MLA). Both layouts are the trainer's own (`Trainer` from
a config, as `titanlite.train` builds it), dp_shard 2, fp32, one after the other in one process
group. Per rank: tokens/s (median over the steps after the first), peak resident memory (of the
process: the second layout's includes what the allocator kept from the first), the routed
experts' bytes a rank computes with (FSDP all-gathers every expert at ep 1; ep 2 keeps each
rank's half), and, from a torch.profiler trace of the same steps (bench/step_breakdown.py's part
ranges, forward and backward), the share of the steps in: the routed experts' compute, the
permutation and combine (the MoE layer's own ops, the ep exchange's forward half included), the
router, the all-to-all ops alone (dispatch, combine, the counts; forward and backward), FSDP's
collectives (all-gathers, reduce-scatters) and attention. What decides ep against FSDP here is
the exchange against what it saves: FSDP's all-gather and reduce-scatter of the experts'
weights; the expert matmuls are the same rows and FLOPs in both. On CPU the exchange is gloo's
over local sockets, so the ratio prices it, not a GPU interconnect. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from titanlite.build import plan_run  # noqa: E402
from titanlite.config import load_config  # noqa: E402
from titanlite.models.moe import moe_layers  # noqa: E402
from titanlite.parallel.memory import peak_rss_bytes, reset_peak_rss  # noqa: E402
from titanlite.trainer import Trainer  # noqa: E402
from step_breakdown import breakdown, mark_parts  # noqa: E402  (bench/, beside this file)

WORLD = 2
EXCHANGE_OPS = ("all_to_all", "alltoall")
FSDP_OPS = ("all_gather", "allgather", "reduce_scatter", "reducescatter")
# (label, parts of bench/step_breakdown.py whose forward and backward it sums)
SHARES = (
    ("experts", ("experts",)),
    ("permute+combine", ("permute+combine",)),
    ("router", ("router",)),
    ("attention", ("attention",)),
)


def expert_compute_bytes(trainer: Trainer) -> dict[int, int]:
    """Filled during forward: each MoE layer's experts' bytes as they compute (after FSDP's
    all-gather, so this rank's experts at ep 2 and all of them at ep 1)."""
    seen: dict[int, int] = {}

    def record(module, _inputs) -> None:
        local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
        seen[id(module)] = sum(t.numel() * t.element_size() for t in local)

    for layer in moe_layers(trainer.model).values():
        layer.experts.register_forward_pre_hook(record)
    return seen


def run_layout(ep: int, args: argparse.Namespace, folder: str) -> dict[str, float]:
    family, flavor = args.model.split(":", 1)
    argv = [
        *("--config", "debug_model", "--model.name", family, "--model.flavor", flavor),
        *("--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", str(args.batch), "--training.mixed_precision_param", "float32"),
        *("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.peak_flops", "1e11"),
        *("--parallelism.expert_parallel_degree", str(ep), "--job.dump_folder", f"{folder}/ep{ep}"),
    ]
    trainer = Trainer(plan_run(load_config(argv), WORLD))
    experts = expert_compute_bytes(trainer)
    mark_parts(trainer.model)
    reset_peak_rss()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            started = time.perf_counter()
            history = trainer.train()
            seconds = time.perf_counter() - started
    finally:
        trainer.close()
    return {
        "tps": statistics.median(h["tps"] for h in history[1:]),
        "peak_rss": peak_rss_bytes(),
        "expert_bytes": sum(experts.values()),
        **shares(profile, seconds),
    }


def shares(profile, seconds: float) -> dict[str, float]:
    """Each SHARES entry's and each kind of collective's share of the profiled steps' wall time."""
    parts = breakdown(profile.events())
    result = {
        label: sum(parts.get((p, phase), 0.0) for p in names for phase in ("fwd", "bwd")) for label, names in SHARES
    }
    averages = profile.key_averages()
    for label, words in (("all-to-all", EXCHANGE_OPS), ("FSDP collectives", FSDP_OPS)):
        result[label] = sum(e.self_cpu_time_total for e in averages if any(w in e.key.lower() for w in words))
    return {label: us / 1e6 / seconds for label, us in result.items()}


def worker(rank: int, port: int, args: argparse.Namespace, folder: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(args.threads)
    results = {ep: run_layout(ep, args, folder) for ep in (1, 2)}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        report(gathered, args)
    dist.barrier()
    dist.destroy_process_group()


def report(ranks: list[dict[int, dict[str, float]]], args: argparse.Namespace) -> None:
    print(
        f"{args.model}, {WORLD} gloo processes (dp_shard 2), float32, batch {args.batch} x seq {args.seq_len} "
        f"per rank, {args.threads} thread(s) each, {args.steps} steps; shares of the profiled steps, the larger "
        "rank's"
    )
    labels = [label for label, _ in SHARES] + ["all-to-all", "FSDP collectives"]
    print("| layout | tokens/s per rank | peak RSS | experts computed with | " + " | ".join(labels) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(labels))
    for ep in (1, 2):
        rows = [rank[ep] for rank in ranks]
        print(
            f"| {'FSDP 2' if ep == 1 else 'ep 2 (FSDP 2 outside the experts)'} | "
            f"{statistics.mean(r['tps'] for r in rows):,.0f} | {max(r['peak_rss'] for r in rows) / 2**30:.2f} GiB | "
            f"{rows[0]['expert_bytes'] / 2**20:.1f} MiB | "
            + " | ".join(f"{max(r[label] for r in rows):.1%}" for label in labels)
            + " |"
        )
    one, two = ([rank[ep] for rank in ranks] for ep in (1, 2))
    print(
        "\nratio ep 2 / ep 1: tokens/s "
        f"{statistics.mean(r['tps'] for r in two) / statistics.mean(r['tps'] for r in one):.2f}, "
        f"peak RSS {max(r['peak_rss'] for r in two) / max(r['peak_rss'] for r in one):.2f}, "
        f"expert bytes computed with {two[0]['expert_bytes'] / one[0]['expert_bytes']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3:debugmodel_moe", help="family:flavor of an MoE model")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(port, args, folder), nprocs=WORLD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
