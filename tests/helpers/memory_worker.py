"""Measure what one training step really holds on each rank, for the planner's tests.

Usage (by tests/runs/test_plan.py): run_ranks(N, [tests/helpers/memory_worker.py, OUT.json, CASES.json], [])
with CASES.json {name: [--config ...]}: each case a run of its own, one after another in the
session's process group (the closed run's tensors freed first, their pages returned).
Run under MALLOC_MMAP_THRESHOLD_=65536 (with glibc's default MALLOC_MMAP_MAX_ and trim
threshold, in place of the launcher's CPU settings, which keep freed memory) so every tensor
is its own mapping and freeing one returns its pages: resident memory then follows the live
tensors.

Each rank trains one step (which allocates gradients and AdamW state), drops the gradients,
and takes its resident memory as the rest (interpreter, libraries, data, weights, optimizer
state). It then resets the peak, trains one more step and reports the peak above that rest:
the activations and working buffers of a step, which the planner estimates. Rank 0 writes
{name: [{"param_bytes", "grad_bytes", "optim_bytes", "rest_bytes", "step_peak_bytes"}, ...]} (one
entry a rank).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch.distributed as dist

from tests.helpers.session_worker import local_bytes
from titanlite.build import plan_run
from titanlite.config import load_config
from titanlite.parallel.distributed import world_from_env
from titanlite.parallel.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from titanlite.trainer import Trainer


def measure(argv: list[str]) -> list[dict]:
    """Every rank's bytes and step peak for one run of `argv`."""
    trainer = Trainer(plan_run(load_config(argv), world_from_env()[1]))
    batches = iter(trainer.data)
    microbatches = trainer.plan.grad_accum_steps
    trainer.train_step([next(batches) for _ in range(microbatches)])
    params = trainer.params  # the trained ones
    sizes = {
        "param_bytes": local_bytes(trainer.model.parameters()),
        "trained_param_bytes": local_bytes(params),
        "grad_bytes": local_bytes(p.grad for p in params),
        "optim_bytes": local_bytes(v for s in trainer.optimizer.state.values() for v in s.values() if v.dim() > 0),
    }
    step_batches = [next(batches) for _ in range(microbatches)]
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    dist.barrier()
    sizes["rest_bytes"] = rss_bytes()
    reset_peak_rss()
    trainer.train_step(step_batches)
    sizes["step_peak_bytes"] = peak_rss_bytes() - sizes["rest_bytes"]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sizes)
    trainer.close()
    return gathered


def main() -> None:
    out_path, cases_path = sys.argv[1], sys.argv[2]
    results = {}
    for name, argv in json.loads(Path(cases_path).read_text()).items():
        results[name] = measure(argv)
        gc.collect()  # the closed run's tensors, before the next run's rest is read
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
