"""Where a profiled training step's time goes, by kind of op: what lies outside its matmuls.

`profile_step(trainer)` runs one more training step under torch.profiler (CPU activity) on
every rank and returns the self CPU time of each op group, plus the step's wall time; the
groups are the ones docs/performance.md has always reported:

- matmul: `aten::mm`, `bmm`, `addmm`, `matmul`'s kernels (the ceiling's own work);
- attention: the SDPA kernels and their backward (flash / memory-efficient / math);
- communication: c10d collectives, `wait_tensor`, FSDP's and the pipeline's send / receive
  ranges, and their waits;
- DTensor: DTensor's dispatch (`PythonSubclass`, redistribution, wrapping);
- copies: `cat`, `copy_`, `stack`, `clone`, `repeat_interleave`, `contiguous`, index copies;
- optimizer: fused or foreach AdamW;
- elementwise: every other `aten::` kernel (norms, SiLU, adds, RoPE, the loss's pointwise
  work, reductions);
- other ranges: self time of `record_function` ranges (FSDP's hooks, autograd's engine) =
  Python and bookkeeping inside them;
- unprofiled: the step's wall time that no op holds (Python between ops, the scheduler,
  waiting on a thread).

Grouping is by op name only, so it works on any layout without knowing its code.
"""

from __future__ import annotations

import time

import torch

GROUPS = (
    "matmul",
    "attention",
    "communication",
    "DTensor",
    "copies",
    "optimizer",
    "elementwise",
    "other ranges",
    "unprofiled",
)

_MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_grouped_mm"}
_COPIES = {
    "aten::cat",
    "aten::copy_",
    "aten::stack",
    "aten::clone",
    "aten::repeat_interleave",
    "aten::contiguous",
    "aten::index_copy_",
    "aten::_to_copy",
    "aten::index_select",
    "aten::split_with_sizes_copy",
    "aten::narrow_copy",
}
_COMMUNICATION_WORDS = (
    "c10d",
    "wait_tensor",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "send",
    "recv",
    "gloo",
    "nccl",
    "_wait",
    "barrier",
)
_DTENSOR_WORDS = ("PythonSubclass", "Redistribute", "_FromTorchTensor", "_ToTorchTensor", "DTensor", "redistribute")


def group_of(name: str) -> str:
    """The group of one profiler op name (see the module docstring)."""
    lower = name.lower()
    if name in _MATMUL:
        return "matmul"
    if "attention" in lower or "scaled_dot_product" in lower:
        return "attention"
    if any(word in name for word in _DTENSOR_WORDS):
        return "DTensor"
    if any(word in lower for word in _COMMUNICATION_WORDS):
        return "communication"
    if name in _COPIES:
        return "copies"
    if "adam" in lower or name.startswith("aten::_foreach") or "optimizer" in lower:
        return "optimizer"
    if name.startswith("aten::"):
        return "elementwise"
    return "other ranges"


def group_seconds(self_seconds: dict[str, float], wall_seconds: float) -> dict[str, float]:
    """Seconds per group from {op name: self CPU seconds}; "unprofiled" is the rest of the wall time."""
    groups = dict.fromkeys(GROUPS, 0.0)
    for name, seconds in self_seconds.items():
        groups[group_of(name)] += seconds
    groups["unprofiled"] = max(0.0, wall_seconds - sum(self_seconds.values()))
    return groups


def profile_step(trainer) -> dict:
    """One more training step of `trainer` (after its timed steps), under the profiler:
    {"wall": seconds, "groups": {group: seconds}, "top": [(op, seconds), ...] (the 12 largest
    outside matmul and attention)}. Every rank runs it (a step's collectives need them all)."""
    import torch.distributed as dist

    batches = iter(trainer.data)
    microbatches = [next(batches) for _ in range(trainer.plan.grad_accum_steps)]
    trainer.state.step += 1
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        loss, _, _ = trainer.train_step(microbatches)
        loss.item()
        wall = time.perf_counter() - start
    self_seconds: dict[str, float] = {}
    for event in profile.key_averages():
        self_seconds[event.key] = self_seconds.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
    outside = sorted(
        ((n, s) for n, s in self_seconds.items() if group_of(n) not in ("matmul", "attention")), key=lambda x: -x[1]
    )
    return {"wall": wall, "groups": group_seconds(self_seconds, wall), "top": outside[:12]}
