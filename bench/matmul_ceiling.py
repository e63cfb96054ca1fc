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
shapes themselves lose. The loss, norms, the attention kernel's softmax and communication are
what lies between. Mixture-of-experts expert weights (grouped matmuls, not nn.Linear) are not
counted.

Attention's own matmuls are counted too (every module with a `head_dim`, its local query
heads read from its output projection, the last nn.Linear it registers: Llama's `wo`,
GPT-2's `c_proj`): per forward and query head, the scores Q K^T and the output P V, and in
the backward dP = dO V^T, dV = P^T dO, dQ = dS K and dK = dS^T Q, as batched matmuls of the
rank's queries (seq / cp) against half the keys (seq / 2): a causal kernel computes half the
square, and a cp rank's queries (two chunks, load-balanced) see half the keys on average.
Block-causal attention needs less still; its ceiling counts the causal half all the same.
(PaLM's model FLOPs, the "% of peak" column's, count the whole square.)
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


# (batch, m, k, n, transpose a, transpose b, count): `count` products of [batch,] m x k by k x n.
Matmul = tuple[int, int, int, int, bool, bool, int]


def step_matmuls(shapes: Counter[tuple[int, int]], tokens: int, forwards: int) -> list[Matmul]:
    """Each matmul of the linears a step does: per linear and forward, X W^T, dY W and dY^T X."""
    matmuls = []
    for (d_in, d_out), count in shapes.items():
        n = count * forwards
        matmuls += [
            (1, tokens, d_in, d_out, False, True, n),
            (1, tokens, d_out, d_in, False, False, n),
            (1, d_out, tokens, d_in, True, False, n),
        ]
    return matmuls


def attention_widths(parts: list[nn.Module]) -> Counter[tuple[int, int]]:
    """(local query heads, head_dim) of every attention module in `parts` (see the module
    docstring): the output projection's input features, tp-sharded ones counted locally."""
    widths: Counter[tuple[int, int]] = Counter()
    for part in parts:
        for module in part.modules():
            head_dim = getattr(module, "head_dim", None)
            linears = [m for m in module.children() if isinstance(m, nn.Linear)]
            if isinstance(head_dim, int) and linears:
                widths[(_computed_shape(linears[-1].weight)[1] // head_dim, head_dim)] += 1
    return widths


def attention_matmuls(
    widths: Counter[tuple[int, int]], sequences: int, q_len: int, k_len: int, forwards: int
) -> list[Matmul]:
    """Each batched matmul of attention a step does: per module and forward, over sequences x
    heads, Q K^T and P V forward, dO V^T, P^T dO, dS K and dS^T Q backward, against the causal
    half of the keys."""
    keys = max(1, k_len // 2)
    matmuls = []
    for (heads, head_dim), count in widths.items():
        b, n = sequences * heads, count * forwards
        matmuls += [
            (b, q_len, head_dim, keys, False, False, n),
            (b, q_len, keys, head_dim, False, False, n),  # forward
            (b, q_len, head_dim, keys, False, False, n),
            (b, keys, q_len, head_dim, False, False, n),  # dP, dV
            (b, q_len, keys, head_dim, False, False, n),
            (b, keys, q_len, head_dim, False, False, n),
        ]  # dQ, dK
    return matmuls


def time_matmuls(
    matmuls: list[Matmul], dtype: torch.dtype, device: torch.device, min_seconds: float = 2.0
) -> tuple[float, float]:
    """Seconds one step's matmuls take, run back to back (the average of whole repeats, at
    least `min_seconds` in all, after one repeat to warm up), and their FLOPs."""
    operands = []
    for batch, m, k, n, trans_a, trans_b, count in matmuls:
        lead = (batch,) if batch > 1 else ()
        a = torch.randn((*lead, k, m) if trans_a else (*lead, m, k), dtype=dtype, device=device)
        b = torch.randn((*lead, n, k) if trans_b else (*lead, k, n), dtype=dtype, device=device)
        operands.append((a.transpose(-1, -2) if trans_a else a, b.transpose(-1, -2) if trans_b else b, count))
    flops = sum(2.0 * batch * m * k * n * count for batch, m, k, n, _, _, count in matmuls)

    def one_step() -> None:
        for a, b, count in operands:
            for _ in range(count):
                torch.matmul(a, b)
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
    sequences = training.local_batch_size // microbatches
    q_len = training.seq_len // dims.cp
    parts = list(trainer.model_parts)
    matmuls = step_matmuls(linear_shapes(parts), sequences * q_len, forwards) + attention_matmuls(
        attention_widths(parts), sequences, q_len, training.seq_len, forwards
    )
    dtype = getattr(torch, training.mixed_precision_param)
    dist.barrier()
    seconds, flops = time_matmuls(matmuls, dtype, trainer.device)
    dist.barrier()
    # The fastest of a few short timings: a neighbour's burst on a shared host lowers a mean.
    peak_seconds, peak_flops = min(
        time_matmuls([(1, 2048, 2048, 2048, False, True, 1)], dtype, trainer.device, min_seconds=0.3) for _ in range(4)
    )
    replica_tokens = plan.grad_accum_steps * training.local_batch_size * training.seq_len
    return {
        "seconds": seconds,
        "flops": flops,
        "peak_flops": peak_flops / peak_seconds,
        "tokens_per_device": replica_tokens / (dims.tp * dims.cp * dims.pp),
    }
