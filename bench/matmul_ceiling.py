"""A layout's ceiling: one training step's own matmuls, timed alone on the rank that runs them.

Every nn.Linear of the rank's model parts (its pipeline stages, its tensor-parallel shard of
each weight) does three matmuls per forward and backward over the tokens the rank computes:
forward X W^T [tokens, in] x [in, out], input gradient dY W and weight gradient dY^T X, each
2 x tokens x in x out FLOPs; as many times as the step has forwards (gradient-accumulation
or pipeline microbatches). The tokens of one forward are the microbatch's sequences times
the sequence length over the cp degree (tensor-parallel ranks compute every token of their
group, with or without sequence parallelism, whose gathers come before the matmuls).

Timing those matmuls alone, in the step's dtype, on the threads and cores the rank trained on
(called at the end of a bench worker, every rank at once after a barrier), gives the time a
step would take if it did nothing else: the step's share of it is how much of the step is
its matmuls, and the ceiling's own FLOP rate over the 2048^3 peak is how much the model's
shapes themselves lose. Attention, the loss, norms and communication are what lies between.
Mixture-of-experts expert weights (grouped matmuls, not nn.Linear) are not counted.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn


def linear_shapes(parts: list[nn.Module]) -> Counter[tuple[int, int]]:
    """(in, out) of every nn.Linear in `parts` as this rank computes it: a weight sharded over
    the "tp" mesh dim counts its local shard; FSDP's shards are gathered before the matmul."""
    shapes: Counter[tuple[int, int]] = Counter()
    for part in parts:
        for module in part.modules():
            if isinstance(module, nn.Linear):
                out_features, in_features = _computed_shape(module.weight)
                shapes[(in_features, out_features)] += 1
    return shapes


def _computed_shape(weight: torch.Tensor) -> list[int]:
    shape = list(weight.shape)
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return shape
    placement = weight.placements[mesh.mesh_dim_names.index("tp")]
    if placement.is_shard():
        shape[placement.dim] //= mesh.size(mesh.mesh_dim_names.index("tp"))
    return shape


def step_matmuls(shapes: Counter[tuple[int, int]], tokens: int, forwards: int) -> list[tuple[int, int, int, bool, bool, int]]:
    """(m, k, n, transpose a, transpose b, count) of each matmul a step does: per linear and
    forward, X W^T, dY W and dY^T X."""
    matmuls = []
    for (d_in, d_out), count in shapes.items():
        n = count * forwards
        matmuls += [(tokens, d_in, d_out, False, True, n), (tokens, d_out, d_in, False, False, n), (d_out, tokens, d_in, True, False, n)]
    return matmuls


def time_matmuls(matmuls: list[tuple[int, int, int, bool, bool, int]], dtype: torch.dtype, device: torch.device,
                 min_seconds: float = 2.0) -> tuple[float, float]:
    """Seconds one step's matmuls take, run back to back (the average of whole repeats, at
    least `min_seconds` in all, after one repeat to warm up), and their FLOPs."""
    operands = []
    for m, k, n, trans_a, trans_b, count in matmuls:
        a = torch.randn((k, m) if trans_a else (m, k), dtype=dtype, device=device)
        b = torch.randn((n, k) if trans_b else (k, n), dtype=dtype, device=device)
        operands.append((a.t() if trans_a else a, b.t() if trans_b else b, count))
    flops = sum(2.0 * m * k * n * count for m, k, n, _, _, count in matmuls)

    def one_step() -> None:
        for a, b, count in operands:
            for _ in range(count):
                torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    one_step()
    repeats, start = 0, time.perf_counter()
    while repeats == 0 or time.perf_counter() - start < min_seconds:
        one_step()
        repeats += 1
    return (time.perf_counter() - start) / repeats, flops


def rank_ceiling(trainer) -> dict[str, float]:
    """This rank's step matmuls timed alone (all ranks at once): {"seconds", "flops",
    "peak_flops", "tokens_per_device"}: then a 2048^3 matmul's FLOP/s on the same threads at
    the same moment (all ranks at once again), the peak the ceiling is compared with on a
    host whose speed moves; and the step's tokens per device as the logged `tps` counts them
    (a data-parallel replica's tokens over its tp x cp x pp devices), so that
    tokens_per_device / tps is the step's time."""
    plan, training = trainer.plan, trainer.cfg.training
    dims, microbatches = plan.dims, plan.pipeline.n_microbatches if plan.pipeline is not None else 1
    forwards = plan.grad_accum_steps * microbatches
    tokens = training.local_batch_size // microbatches * training.seq_len // dims.cp
    matmuls = step_matmuls(linear_shapes(list(trainer.model_parts)), tokens, forwards)
    dtype = getattr(torch, training.mixed_precision_param)
    dist.barrier()
    seconds, flops = time_matmuls(matmuls, dtype, trainer.device)
    dist.barrier()
    # The fastest of a few short timings: a neighbour's burst on a shared host lowers a mean.
    peak_seconds, peak_flops = min(time_matmuls([(2048, 2048, 2048, False, True, 1)], dtype, trainer.device, min_seconds=0.3)
                                   for _ in range(4))
    replica_tokens = plan.grad_accum_steps * training.local_batch_size * training.seq_len
    return {"seconds": seconds, "flops": flops, "peak_flops": peak_flops / peak_seconds,
            "tokens_per_device": replica_tokens / (dims.tp * dims.cp * dims.pp)}
