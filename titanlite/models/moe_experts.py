"""The routed experts of a mixture-of-experts layer (models/moe.py): one SwiGLU MLP per
expert, held as stacked weights and run over the tokens grouped by expert.

Stacked weights (`w1 [E, hidden, dim]`, `w2 [E, dim, hidden]`, `w3 [E, hidden, dim]`, each
expert's slice laid out as a Llama `nn.Linear` weight) are three parameters however many
experts there are: FSDP shards three tensors instead of 3E, an expert-parallel plan shards
dim 0, and a grouped matmul takes them whole.

Dropless: the caller hands over every routed (token, expert) pair sorted by expert with the
count of each group; every pair is computed, whatever the load (no capacity factor, no
token dropped or padded).

Two ways to run the groups give the same numbers: torch's grouped matmul (one kernel over all
groups, `torch.nn.functional.grouped_mm`, `torch._grouped_mm` before it was public) and a loop
over experts (one matmul per group). `use_grouped_mm` picks from the device and dtype at run
time: the grouped kernel where torch documents one (bfloat16 on CUDA, compute capability 8.0 or
newer), the loop elsewhere. On CPU torch 2.13's grouped matmul runs (float32, bfloat16, float16;
not float64) and equals the loop forward and backward to rounding (tests/unit/test_moe.py), but
it is no faster, needs every stride a multiple of 16 bytes, and its backward fails on an
expanded gradient (as `out.sum().backward()` gives): the loop is the CPU path.

The weights are read as the plain tensors this rank computes with (`local_tensor`). Under tensor
parallelism a mixture-of-experts layer runs whole on every rank (its parameters Replicate
DTensors on the tp mesh, so every parameter shares one mesh for the grad norm and FSDP), on plain
tensors: routing (top-k, counts, sorting) has no DTensor rules. `to_local` is differentiable: the
gradient comes back as the Replicate DTensor every rank computed in full. Under expert
parallelism the routed experts are Shard(0) DTensors over the ep ranks
(parallel/expert_parallel.py): the local tensor is this rank's experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.init import ShardInit
from titanlite.parallel.placement import local_tensor

# torch 2.13 makes the grouped matmul public; torch 2.11 (the GPU machines) has only the
# private op, with the same signature.
_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def use_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """True where torch's grouped matmul is one native kernel: bfloat16 on a CUDA device of
    compute capability 8.0 (Ampere) or newer, as torch documents it. Elsewhere the experts
    run as a loop, which gives the same numbers."""
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)


def _aligned(*weights: torch.Tensor) -> bool:
    """The grouped kernel's layout rule: each weight's rows start 16 bytes apart or a
    multiple (dims of 8 bf16 values; real models' are, tiny test models may not be)."""
    return all(w.shape[-1] * w.element_size() % 16 == 0 for w in weights)


def run_experts_grouped(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of each group of rows of `x` [n, dim] through its expert, in three grouped
    matmuls; `counts` [E] rows per expert, in expert order (zero allowed). No host sync."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate = _grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
    hidden = F.silu(gate) * _grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return _grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)


def run_experts_loop(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The same as `run_experts_grouped`, one expert at a time (reads `counts` on the host).
    The weights are unbound once: indexing `w1[e]` per expert would make backward build a
    zero-filled gradient of the whole stack for each expert (E^2 work: 20x the step with 64)."""
    groups = x.split(counts.tolist())
    experts = zip(w1.unbind(0), w2.unbind(0), w3.unbind(0))
    return torch.cat([F.linear(F.silu(F.linear(g, a)) * F.linear(g, c), b) for g, (a, b, c) in zip(groups, experts)])


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of interleaved [gate_0, up_0, gate_1, up_1, ...] columns: the gate
    clamped above and the up projection on both sides at `limit`, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GroupedExperts(nn.Module):
    """E SwiGLU experts: rows of x sorted by expert [n, dim], counts [E] -> [n, dim]."""

    # The hidden dim of each weight, which expert tensor parallelism splits over tp
    # (parallel/expert_tensor_parallel.py): w1 and w3 column-wise, w2 row-wise.
    tensor_parallel_dims = {"w1": 1, "w2": 2, "w3": 1}

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = local_tensor(self.w1), local_tensor(self.w2), local_tensor(self.w3)
        grouped = use_grouped_mm(x.device, x.dtype) and w1.dtype == x.dtype and _aligned(w1, w2)
        run = run_experts_grouped if grouped else run_experts_loop
        return run(w1, w2, w3, x, counts)

    def init_weights(self, init: ShardInit, std: float) -> None:
        """w1 std 0.02, w2 and w3 `std` (models/moe.MoE.init_weights)."""
        init.trunc_normal(self.w1, std=0.02)
        init.trunc_normal(self.w2, std=std)
        init.trunc_normal(self.w3, std=std)


class ClampedSwiGLUExperts(nn.Module):
    """gpt-oss's E experts in Hugging Face's layout, so its files map by name alone, per rank:
    `gate_up_proj [E, dim, 2 * hidden]` (input-major, gate and up columns interleaved),
    `gate_up_proj_bias [E, 2 * hidden]`, `down_proj [E, hidden, dim]`, `down_proj_bias [E, dim]`;
    the clamped SwiGLU between (`clamped_swiglu`). Rows sorted by expert [n, dim], counts [E] ->
    [n, dim], as `GroupedExperts`; the grouped matmul where it is native, else a loop."""

    # The hidden dim of each weight (expert tensor parallelism): a contiguous block of the
    # interleaved columns holds whole (gate, up) pairs. The output bias has none: not split.
    tensor_parallel_dims = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        up, up_bias, down, down_bias = (
            local_tensor(p) for p in (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias)
        )
        if use_grouped_mm(x.device, x.dtype) and up.dtype == x.dtype and _aligned(up, down):
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            rows_bias = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=len(x))
            hidden = _grouped_mm(x, up, offs=offsets) + up_bias[rows_bias]
            hidden = clamped_swiglu(hidden, self.alpha, self.limit)
            return _grouped_mm(hidden, down, offs=offsets) + down_bias[rows_bias]
        groups = x.split(counts.tolist())
        experts = zip(up.unbind(0), up_bias.unbind(0), down.unbind(0), down_bias.unbind(0))
        return torch.cat(
            [clamped_swiglu(g @ a + ab, self.alpha, self.limit) @ d + db for g, (a, ab, d, db) in zip(groups, experts)]
        )

    def init_weights(self, init: ShardInit, std: float) -> None:
        """The fused input projection std 0.02, the output projection `std`, biases zero."""
        init.trunc_normal(self.gate_up_proj, std=0.02)
        init.trunc_normal(self.down_proj, std=std)
        init.zeros(self.gate_up_proj_bias)
        init.zeros(self.down_proj_bias)
